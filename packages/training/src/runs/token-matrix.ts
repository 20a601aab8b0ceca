import { InvalidInputError } from "@arbor/store";

/**
 * TokenMatrix batches of the native training API (ADR 57; the spec's `TokenRow`): decoded from
 * their dense or span-encoded rows and checked against the loss and the base model, once when a
 * command is admitted (400 before any sequence id is taken) and again where it runs.
 */

export type RowScalar = number | boolean;
export type RowElement = RowScalar | RowScalar[];
export interface WireRow {
  name: string;
  dtype: "bool" | "int32" | "int64" | "float32";
  shape: number[];
  values:
    | { encoding: "dense"; data: RowScalar[] }
    | {
        encoding: "spans";
        default: RowElement;
        spans: { start: number; end: number; value: RowElement }[];
      };
}
export interface WireMatrix {
  kind?: "matrix";
  matrix_id: string;
  packing_affinity_id?: string | null;
  rows: WireRow[];
}
export interface WireBatch {
  kind?: "token_matrix";
  matrices: WireMatrix[];
  routes?: unknown[];
}
export type LossName = "cross_entropy" | "importance_sampling" | "cispo" | "dpo" | "ppo" | "dro";
export interface WireLoss {
  name: LossName;
  normalize_advantages?: boolean;
  clip_low_threshold?: number;
  clip_high_threshold?: number;
  /** DRO's β (Tinker's `dro`, ADR 71); default 0.05. */
  beta?: number;
  /**
   * `sum`: the loss is the sum over the batch's active positions, and a matrix may have none
   * (Tinker's losses, ADR 71); default: the mean over them, each matrix needing one (ADR 57).
   * `ppo`, `dro` and `sum` are Tinker's only: the native API's spec does not name them.
   */
  reduction?: "mean" | "sum";
}

/** One matrix decoded: T positions, K targets each (row-major `[T, K]` coefficients). */
export interface Matrix {
  id: string;
  T: number;
  K: number;
  tokens: Int32Array;
  targets: Int32Array;
  /** Per target; 1 where the row is absent. */
  weights: Float32Array;
  advantages: Float32Array | null;
  behavior: Float32Array | null;
  /** Per position; null when the row is absent. */
  policyVersions: number[] | null;
  /** Positions that bear loss: a nonzero loss weight (cross-entropy) or advantage. */
  active: Uint8Array;
  activeCount: number;
}

/** What the base model allows. */
export interface MatrixLimits {
  vocabSize: number;
  maxPositions: number;
}

export const MAX_BATCH_TOKENS = 2 ** 20;
export const MAX_TARGETS = 256;
const POLICY_LOSSES: ReadonlySet<LossName> = new Set([
  "importance_sampling",
  "cispo",
  "ppo",
  "dro",
]);
/** The losses with a clamped ratio, and their default thresholds: CISPO's one-sided clamp,
 * PPO's ε = 0.2 (Tinker's documented defaults, ADR 71). */
const CLIPPED: Readonly<Partial<Record<LossName, { low: number; high: number }>>> = {
  cispo: { low: 0, high: 4 },
  ppo: { low: 0.8, high: 1.2 },
};
const ROWS: Readonly<Record<string, { dtype: WireRow["dtype"]; perTarget: boolean }>> = {
  token_ids: { dtype: "int64", perTarget: false },
  target_token_ids: { dtype: "int64", perTarget: true },
  loss_weights: { dtype: "float32", perTarget: true },
  advantages: { dtype: "float32", perTarget: true },
  behavior_logprobs: { dtype: "float32", perTarget: true },
  policy_version: { dtype: "int64", perTarget: false },
};

function invalid(message: string, code = "invalid_token_matrix"): never {
  throw new InvalidInputError(message, { code, param: "batch" });
}

/** The loss's options checked (400 `unsupported_loss`, `invalid_loss_options`): the clamp of
 * CISPO and PPO, DRO's β. */
function checkLoss(loss: WireLoss): { low: number; high: number; beta: number } {
  if (loss.name === "dpo")
    throw new InvalidInputError(
      "The dpo loss needs chosen/rejected pairs, which a TokenMatrix batch cannot carry",
      { code: "unsupported_loss", param: "loss.name" },
    );
  const clip = loss.clip_low_threshold !== undefined || loss.clip_high_threshold !== undefined;
  const defaults = CLIPPED[loss.name];
  if (clip && !defaults)
    throw new InvalidInputError(`Clip thresholds are not options of ${loss.name}`, {
      code: "invalid_loss_options",
      param: "loss",
    });
  if (loss.beta !== undefined && loss.name !== "dro")
    throw new InvalidInputError(`beta is not an option of ${loss.name}`, {
      code: "invalid_loss_options",
      param: "loss",
    });
  const beta = loss.beta ?? 0.05;
  if (!(Number.isFinite(beta) && beta >= 0))
    throw new InvalidInputError(`beta ${beta} is not a finite number ≥ 0`, {
      code: "invalid_loss_options",
      param: "loss",
    });
  const low = loss.clip_low_threshold ?? defaults?.low ?? 0;
  const high = loss.clip_high_threshold ?? defaults?.high ?? 4;
  if (low > high)
    throw new InvalidInputError(`clip_low_threshold ${low} is above clip_high_threshold ${high}`, {
      code: "invalid_loss_options",
      param: "loss",
    });
  return { low, high, beta };
}

/** A row's values written out, row-major; throws on a span or value that does not fit. */
function denseValues(row: WireRow, T: number, width: number): number[] {
  const element = (v: RowElement): number[] => {
    const list = (Array.isArray(v) ? v : [v]).map(Number);
    if (list.length !== width)
      invalid(`row ${row.name}: a span or default has ${list.length} values, not ${width}`);
    return list;
  };
  let out: number[];
  if (row.values.encoding === "dense") {
    out = row.values.data.map(Number);
    if (out.length !== T * width)
      invalid(`row ${row.name} has ${out.length} values, not ${T * width} as its shape says`);
  } else {
    const fill = element(row.values.default);
    out = new Array<number>(T * width);
    for (let p = 0; p < T; p++) for (let k = 0; k < width; k++) out[p * width + k] = fill[k]!;
    for (const span of row.values.spans) {
      if (!(span.start >= 0 && span.start < span.end && span.end <= T))
        invalid(`row ${row.name}: span [${span.start}, ${span.end}) is outside [0, ${T})`);
      const value = element(span.value);
      for (let p = span.start; p < span.end; p++)
        for (let k = 0; k < width; k++) out[p * width + k] = value[k]!;
    }
  }
  const integer = row.dtype === "int64" || row.dtype === "int32";
  for (const v of out)
    if (!Number.isFinite(v) || (integer && !Number.isSafeInteger(v)))
      invalid(`row ${row.name} has a value that is not ${integer ? "an integer" : "finite"}`);
  return out;
}

function ids(values: number[], what: string, vocabSize: number): Int32Array {
  for (const v of values)
    if (v < 0 || v >= vocabSize)
      invalid(
        `${what} has id ${v}, outside the base model's vocabulary of ${vocabSize}`,
        "token_out_of_vocabulary",
      );
  return Int32Array.from(values);
}

/** Decodes and checks a batch for `loss` (400 with the ADR's codes); answers its matrices. */
export function decodeBatch(batch: WireBatch, loss: WireLoss, limits: MatrixLimits): Matrix[] {
  checkLoss(loss);
  const policy = POLICY_LOSSES.has(loss.name);
  if ((batch.routes ?? []).length > 0)
    invalid("routes must be empty: Arbor's models are dense (no expert routing to replay)");
  if (batch.matrices.length === 0) invalid("the batch has no matrix");
  const seen = new Set<string>();
  let total = 0;
  const matrices = batch.matrices.map((m) => {
    if (seen.has(m.matrix_id)) invalid(`two matrices are named ${m.matrix_id}`);
    seen.add(m.matrix_id);
    const rows = new Map<string, WireRow>();
    for (const row of m.rows) {
      const rule = ROWS[row.name];
      if (!rule) invalid(`matrix ${m.matrix_id} has a row Arbor does not read: ${row.name}`);
      if (rows.has(row.name)) invalid(`matrix ${m.matrix_id} has two ${row.name} rows`);
      if (row.dtype !== rule.dtype)
        invalid(`row ${row.name} must be ${rule.dtype}, not ${row.dtype}`);
      rows.set(row.name, row);
    }
    const need = ["token_ids", "target_token_ids", policy ? "advantages" : "loss_weights"];
    if (policy) need.push("behavior_logprobs");
    for (const name of need)
      if (!rows.has(name))
        invalid(`matrix ${m.matrix_id} has no ${name} row, which ${loss.name} needs`);
    const tokenRow = rows.get("token_ids")!;
    if (tokenRow.shape.length !== 1) invalid("token_ids must have shape [T]");
    const T = tokenRow.shape[0]!;
    if (T > limits.maxPositions)
      invalid(
        `matrix ${m.matrix_id} has ${T} tokens, more than the base model's context of ${limits.maxPositions}`,
        "context_length_exceeded",
      );
    total += T;
    const targetRow = rows.get("target_token_ids")!;
    if (targetRow.shape.length !== 2 || targetRow.shape[0] !== T)
      invalid(`target_token_ids must have shape [${T}, K]`);
    const K = targetRow.shape[1]!;
    if (K > (loss.name === "cross_entropy" ? MAX_TARGETS : 1))
      invalid(
        `${loss.name} takes ${loss.name === "cross_entropy" ? MAX_TARGETS : 1} target(s) per position at most, not ${K}`,
      );
    const coefficient = (name: string): Float32Array | null => {
      const row = rows.get(name);
      if (!row) return null;
      if (row.shape.length !== 2 || row.shape[0] !== T || row.shape[1] !== K)
        invalid(`row ${name} must have the targets' shape [${T}, ${K}]`);
      return Float32Array.from(denseValues(row, T, K));
    };
    const tokens = ids(denseValues(tokenRow, T, 1), "token_ids", limits.vocabSize);
    const targets = ids(denseValues(targetRow, T, K), "target_token_ids", limits.vocabSize);
    const weights = coefficient("loss_weights") ?? new Float32Array(T * K).fill(1);
    const advantages = coefficient("advantages");
    const behavior = coefficient("behavior_logprobs");
    const versionRow = rows.get("policy_version");
    let policyVersions: number[] | null = null;
    if (versionRow) {
      const ok =
        versionRow.shape[0] === T &&
        (versionRow.shape.length === 1 ||
          (versionRow.shape.length === 2 && versionRow.shape[1] === 1));
      if (!ok) invalid(`policy_version must have shape [${T}] or [${T}, 1]`);
      policyVersions = denseValues(versionRow, T, 1);
    }
    const decisive = policy ? advantages! : weights;
    const active = new Uint8Array(T);
    let activeCount = 0;
    for (let p = 0; p < T; p++) {
      for (let k = 0; k < K; k++) if (decisive[p * K + k] !== 0) active[p] = 1;
      activeCount += active[p]!;
    }
    if (activeCount === 0 && loss.reduction !== "sum")
      invalid(`matrix ${m.matrix_id} has no active position`);
    return {
      id: m.matrix_id,
      T,
      K,
      tokens,
      targets,
      weights,
      advantages,
      behavior,
      policyVersions,
      active,
      activeCount,
    };
  });
  if (total > MAX_BATCH_TOKENS)
    invalid(`the batch has ${total} tokens, more than ${MAX_BATCH_TOKENS}`, "batch_too_large");
  return matrices;
}

/**
 * Tokens trained per learner version that sampled them, when every matrix says (ART's
 * `policy_token_counts`); null when some active position's version is unknown.
 */
export function policyTokenCounts(
  matrices: readonly Matrix[],
): { policy_version: number; accepted_trainable_tokens: number }[] | null {
  const counts = new Map<number, number>();
  for (const m of matrices) {
    if (!m.policyVersions) return null;
    for (let p = 0; p < m.T; p++) {
      if (!m.active[p]) continue;
      const v = m.policyVersions[p]!;
      if (v < 0) return null;
      counts.set(v, (counts.get(v) ?? 0) + 1);
    }
  }
  return [...counts.entries()]
    .sort(([a], [b]) => a - b)
    .map(([policy_version, accepted_trainable_tokens]) => ({
      policy_version,
      accepted_trainable_tokens,
    }));
}

/**
 * The loss at one target column of a matrix, as a sum over its active positions, and its
 * gradient by the log-probs (ADR 57; the spec's `TrainingLoss`): cross-entropy −w·log π,
 * importance sampling −ρ·A·w, CISPO −clamp(ρ)·log π·A·w with the clamped ratio held constant;
 * Tinker's PPO −min(ρ·A, clamp(ρ)·A)·w and DRO −(log π·A − β/2·(log π − q)²)·w (ADR 71).
 */
export function lossObjective(
  matrix: Matrix,
  loss: WireLoss,
  column: number,
  scale: number,
): (logprobs: Float32Array) => { loss: number; grad: Float32Array } {
  const { low, high, beta } = checkLoss(loss);
  const { T, K, weights, advantages, behavior, active } = matrix;
  return (logprobs) => {
    const grad = new Float32Array(logprobs.length);
    let sum = 0;
    for (let p = 0; p < T; p++) {
      if (!active[p]) continue;
      const i = p * K + column;
      const logp = logprobs[p]!;
      const w = weights[i]!;
      if (loss.name === "cross_entropy") {
        sum += -w * logp;
        grad[p] = -w;
        continue;
      }
      const a = advantages![i]! * scale;
      const ratio = Math.exp(logp - behavior![i]!);
      if (loss.name === "importance_sampling") {
        sum += -ratio * a * w;
        grad[p] = -ratio * a * w;
      } else if (loss.name === "ppo") {
        // The smaller surrogate bears the gradient: the ratio's, or the clamped one's, which
        // is constant wherever it is the smaller (the ratio is then outside [low, high]).
        const clamped = Math.min(Math.max(ratio, low), high);
        const unclipped = ratio * a;
        sum += -Math.min(unclipped, clamped * a) * w;
        grad[p] = unclipped <= clamped * a ? -ratio * a * w : 0;
      } else if (loss.name === "dro") {
        const d = logp - behavior![i]!;
        sum += -(logp * a - 0.5 * beta * d * d) * w;
        grad[p] = -(a - beta * d) * w;
      } else {
        const clamped = Math.min(Math.max(ratio, low), high);
        sum += -clamped * logp * a * w;
        grad[p] = -clamped * a * w;
      }
    }
    return { loss: sum, grad };
  };
}

/**
 * The factor advantages are multiplied by: with `normalize_advantages`, one over the mean of
 * |A|·w over the batch's active positions; else 1.
 */
export function advantageScale(matrices: readonly Matrix[], loss: WireLoss): number {
  if (!POLICY_LOSSES.has(loss.name) || !(loss.normalize_advantages ?? true)) return 1;
  let sum = 0;
  let n = 0;
  for (const m of matrices)
    for (let p = 0; p < m.T; p++) {
      if (!m.active[p]) continue;
      sum += Math.abs(m.advantages![p * m.K]!) * m.weights[p * m.K]!;
      n++;
    }
  const mean = sum / n;
  return Number.isFinite(mean) && mean > 0 ? 1 / mean : 1;
}
