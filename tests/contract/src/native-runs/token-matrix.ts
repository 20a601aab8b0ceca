import type {
  RowDType,
  RowScalar,
  TokenLogprobs,
  TokenMatrix,
  TokenMatrixBatch,
  TokenRow,
} from "./wire.ts";

/**
 * TokenMatrix batches as ART lowers its data (its `art.preprocessing.token_matrix`): SFT
 * examples (`token_matrix_batch_from_sft`) and completed RL rollouts
 * (`token_matrix_batch_from_art_rollouts`), with the coefficient rows span-encoded where that is
 * shorter, as ART sends them.
 */

export function denseRow(
  name: string,
  dtype: RowDType,
  shape: number[],
  data: RowScalar[],
): TokenRow {
  return { name, dtype, shape, values: { encoding: "dense", data } };
}

/** A float32 `[T, 1]` row: spans of its nonzero runs over a default of 0 when that takes fewer
 * numbers than the dense values (3 per span and the default), else dense. */
export function coefficientRow(name: string, values: readonly number[]): TokenRow {
  const spans = spansOf(values, 0).map((s) => ({ ...s, value: [s.value] }));
  const shape = [values.length, 1];
  return spans.length * 3 + 1 < values.length
    ? { name, dtype: "float32", shape, values: { encoding: "spans", default: [0], spans } }
    : denseRow(name, "float32", shape, [...values]);
}

/** An int64 `[T]` row of learner versions: spans over a default of −1 (unknown). */
export function policyVersionRow(values: readonly number[]): TokenRow {
  return {
    name: "policy_version",
    dtype: "int64",
    shape: [values.length],
    values: { encoding: "spans", default: -1, spans: spansOf(values, -1) },
  };
}

interface NumberSpan {
  start: number;
  end: number;
  value: number;
}

/** The runs of equal values, `[start, end)`, but those of `fallback` (a row's default). */
function spansOf(values: readonly number[], fallback: number): NumberSpan[] {
  const spans: NumberSpan[] = [];
  for (let start = 0; start < values.length; ) {
    let end = start + 1;
    while (end < values.length && values[end] === values[start]) end++;
    if (values[start] !== fallback) spans.push({ start, end, value: values[start]! });
    start = end;
  }
  return spans;
}

export function batchOf(matrices: TokenMatrix[]): TokenMatrixBatch {
  return { kind: "token_matrix", matrices, routes: [] };
}

/** One tokenized SFT example: its ids and its labels (−100 where no loss is taken), unpadded. */
export interface SftTokens {
  inputIds: readonly number[];
  labels: readonly number[];
}

/**
 * `token_matrix_batch_from_sft`: each position predicts the next label (the last one nothing),
 * weight 1 where there is a label, target 0 where there is none; an example without any label
 * is left out, and a batch of none is null.
 */
export function tokenMatrixBatchFromSft(
  examples: readonly SftTokens[],
  matrixIdPrefix = "sft",
): TokenMatrixBatch | null {
  const matrices: TokenMatrix[] = [];
  examples.forEach(({ inputIds, labels }, index) => {
    if (labels.length !== inputIds.length) throw new Error("SFT ids and labels differ in length");
    const targets = [...labels.slice(1), -100];
    const weights = targets.map((t) => (t === -100 ? 0 : 1));
    if (!weights.some((w) => w !== 0)) return;
    const T = inputIds.length;
    matrices.push({
      kind: "matrix",
      matrix_id: `${matrixIdPrefix}-${index}`,
      packing_affinity_id: null,
      rows: [
        denseRow("token_ids", "int64", [T], [...inputIds]),
        denseRow(
          "target_token_ids",
          "int64",
          [T, 1],
          targets.map((t) => (t === -100 ? 0 : t)),
        ),
        coefficientRow("loss_weights", weights),
      ],
    });
  });
  return matrices.length > 0 ? batchOf(matrices) : null;
}

/** One completed rollout as ART tokenizes it (`TokenizedResult`). */
export interface TokenizedRollout {
  tokenIds: readonly number[];
  /** 1 at the assistant's (sampled) tokens. */
  assistantMask: readonly number[];
  /** The sampler's log-probability of each token (NaN where there is none). */
  logprobs: readonly number[];
  advantage: number;
  weight: number;
  /** The index of its trajectory group. */
  promptId: number;
  /** The learner version that sampled each token, when known. */
  policyVersions?: readonly number[] | null;
}

/**
 * `token_matrix_batch_from_art_rollouts`: targets are the ids shifted left (0 last), active where
 * the next token is the assistant's. Loss weights are the rollouts' weights over their mean at
 * active positions; advantages are balanced, divided by the mean |A|·w (with
 * `normalizeAdvantages`), zero where inactive; behavior log-probs are the next token's. A
 * `policy_version` row comes when every active position's version is known.
 */
export function tokenMatrixBatchFromArtRollouts(
  results: readonly TokenizedRollout[],
  options: {
    normalizeAdvantages?: boolean;
    advantageBalance?: number;
    matrixIdPrefix?: string;
  } = {},
): TokenMatrixBatch {
  const normalize = options.normalizeAdvantages ?? true;
  const balance = options.advantageBalance ?? 0;
  const prefix = options.matrixIdPrefix ?? "rollout";
  if (results.length === 0) throw new Error("ART rollout lowering requires at least one sequence");
  if (!(balance >= -1 && balance <= 1)) throw new Error("advantage_balance must be in [-1, 1]");
  const masks = results.map((r) => [...r.assistantMask.slice(1), 0].map((m) => m !== 0));
  const activeWeights = results.flatMap((r, i) => masks[i]!.filter(Boolean).map(() => r.weight));
  if (activeWeights.length === 0) throw new Error("ART rollout batch has no loss-bearing target");
  const weightMean = activeWeights.reduce((a, b) => a + b, 0) / activeWeights.length;
  if (!Number.isFinite(weightMean) || weightMean === 0)
    throw new Error("ART rollout weights cannot be normalized");
  const advantages = results.map((r) => {
    if (balance > 0 && r.advantage <= 0) return r.advantage * (1 - balance);
    if (balance < 0 && r.advantage >= 0) return r.advantage * (1 + balance);
    return r.advantage;
  });
  const scaled = results.flatMap((r, i) =>
    masks[i]!.filter(Boolean).map(() => Math.abs(advantages[i]!) * (r.weight / weightMean)),
  );
  const scale = normalize ? scaled.reduce((a, b) => a + b, 0) / scaled.length : 1;
  if (!Number.isFinite(scale) || scale === 0)
    throw new Error("ART rollout advantages cannot be normalized");
  const matrices = results.map((r, i): TokenMatrix => {
    const mask = masks[i]!;
    const T = r.tokenIds.length;
    if (T < 1 || r.assistantMask.length !== T || r.logprobs.length !== T)
      throw new Error("tokenized rollout arrays are not aligned");
    const behavior = [...r.logprobs.slice(1), 0];
    if (mask.some((active, p) => active && !Number.isFinite(behavior[p]!)))
      throw new Error("loss-bearing rollout tokens require behavior logprobs");
    const rows: TokenRow[] = [
      denseRow("token_ids", "int64", [T], [...r.tokenIds]),
      denseRow("target_token_ids", "int64", [T, 1], [...r.tokenIds.slice(1), 0]),
      coefficientRow(
        "loss_weights",
        mask.map((active) => (active ? r.weight / weightMean : 0)),
      ),
      coefficientRow(
        "advantages",
        mask.map((active) => (active ? advantages[i]! / scale : 0)),
      ),
      coefficientRow(
        "behavior_logprobs",
        mask.map((active, p) => (active ? behavior[p]! : 0)),
      ),
    ];
    if (r.policyVersions) {
      const shifted = [...r.policyVersions.slice(1), -1];
      if (mask.every((active, p) => !active || shifted[p]! >= 0))
        rows.push(policyVersionRow(shifted));
    }
    return {
      kind: "matrix",
      matrix_id: `${prefix}-${i}`,
      packing_affinity_id: `prompt-${r.promptId}`,
      rows,
    };
  });
  return batchOf(matrices);
}

/** A row's values written out, as `TokenRow.dense_values` reads spans. */
export function denseValues(row: TokenRow): RowScalar[] {
  if (row.values.encoding === "dense") return row.values.data;
  const width = row.shape.slice(1).reduce((a, b) => a * b, 1);
  const element = (v: RowScalar | RowScalar[]) => (Array.isArray(v) ? v : [v]);
  const out: RowScalar[] = [];
  for (let p = 0; p < row.shape[0]!; p++) out.push(...element(row.values.default));
  for (const span of row.values.spans) {
    const value = element(span.value);
    for (let p = span.start; p < span.end; p++) out.splice(p * width, width, ...value);
  }
  return out;
}

/** The learner log-probs of a result, as float32 values. */
export function logprobValues(t: TokenLogprobs): number[] {
  const bytes = Buffer.from(t.data, "base64");
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
  return Array.from({ length: bytes.length / 4 }, (_, i) => view.getFloat32(i * 4, true));
}

/** How many positions a loss takes: those with a nonzero advantage (policy losses) or loss
 * weight (`active_loss_positions`). */
export function activePositions(matrix: TokenMatrix, policyLoss: boolean): number {
  const row = matrix.rows.find((r) => r.name === (policyLoss ? "advantages" : "loss_weights"));
  if (!row) return 0;
  const values = denseValues(row);
  const width = values.length / row.shape[0]!;
  let active = 0;
  for (let p = 0; p < row.shape[0]!; p++)
    if (values.slice(p * width, (p + 1) * width).some((v) => Number(v) !== 0)) active++;
  return active;
}
