import { type ChatMessage, PromptError } from "../model/chat.ts";
import type { LoraAdapter } from "../model/lora.ts";
import type { LoraTrainer } from "./lora-train.ts";
import { microBatches, packBatch } from "./sft.ts";
import { microBatchBudget } from "./train-memory.ts";
import { TrainingInputError, toChatMessage } from "./training-data.ts";

/** A group of rollouts of one prompt: `{trajectories, exceptions?, metadata?, metrics?, logs?}`;
 * unknown keys ignored. */
export interface TrajectoryGroup {
  trajectories: readonly Trajectory[];
  [key: string]: unknown;
}

/**
 * `messages_and_choices`: items with `role` are context; items with `message` + `finish_reason` +
 * `index` (OpenAI choices, with `logprobs.content[].logprob` when sampled with logprobs) are
 * trainable assistant turns.
 */
export interface Trajectory {
  messages_and_choices: readonly unknown[];
  reward: number;
  tools?: readonly Record<string, unknown>[];
  [key: string]: unknown;
}

export type RlLoss = "ppo" | "cispo" | "pg";

/** How a token's importance ratio is formed: its own, its sequence's (the geometric mean over
 * the sequence's trained tokens), or the arithmetic or geometric mean of the two. */
export type ImportanceSamplingLevel = "token" | "sequence" | "average" | "geometric_average";

/**
 * One RL step as OpenPipe ART's trainer defines it (the hosted API's `experimental_config`):
 * group-relative advantages, per-trajectory weights, batch normalization, then per token an
 * importance ratio ρ = π/π_sampling, shaped and clipped, in the chosen loss.
 */
export interface RlConfig {
  /**
   * `cispo`: −sg(clip(ρ, 1−ε, 1+ε_high))·A·log π (default; ε 1, ε_high 4); `ppo`:
   * −min(ρA, clip(ρ, 1−ε, 1+ε_high)·A) (ε 0.2, ε_high = ε); `pg`: −A·log π, no ratio.
   */
  lossFn?: RlLoss;
  epsilon?: number;
  epsilonHigh?: number;
  /** Divide each group's advantages by its reward standard deviation (+1e-6). Default true. */
  scaleRewards?: boolean;
  /** In [−1, 1]: > 0 shrinks negative advantages by that fraction, < 0 positive ones. */
  advantageBalance?: number;
  importanceSamplingLevel?: ImportanceSamplingLevel;
  /** ρ is capped here (every token, despite the hosted name). */
  maxImportanceWeight?: number;
  /** ρ outside (1−ε, 1+ε_high) becomes 0: those tokens get no gradient. */
  maskProbRatio?: boolean;
  /** Kimi K2's shaping: A −= τ·(log π − log π_sampling). */
  kimiK2Tau?: number;
  /** KL shaping of the advantage against `klReference`: A += coef·(mean KL − KL_t) per sequence,
   * KL_t = log p_source − log p_ref (k1). 0 disables. */
  klPenaltyCoef?: number;
  /** Whose log-probs the KL is taken from: the learner's (default) or the sampler's. */
  klPenaltySource?: "current_learner" | "sample";
  /** The KL reference policy: an adapter of the same base, or null for the base model itself. */
  klReference?: LoraAdapter | null;
  /** Each token's loss is scaled by min(ρ_tis, this): ρ_tis is ρ, or with `precalculateLogprobs`
   * π_learner/π_sampling. */
  truncatedImportanceSampling?: number;
  /** The ratio's denominator is the learner's own log-probs at the step's start (so ρ = 1) and
   * the sampler's only weight truncated importance sampling. */
  precalculateLogprobs?: boolean;
  /**
   * Turns without sampling logprobs: `false` drops them (a choice without `logprobs` is not
   * trained), `true` trains them with ρ = 1 and trains plain assistant messages too; unset (this
   * API's own default) trains choices without logprobs with ρ = 1 and keeps messages as context.
   */
  allowTrainingWithoutLogprobs?: boolean;
  /** Histories longer than this many tokens are dropped. Default: the model's context (longer
   * ones are cut to it). */
  maxSequenceLength?: number;
  /** Largest padded micro-batch run at once (gradients accumulate). Default 4096. */
  microBatchTokens?: number;
}

/** The step's metrics, named as the contract's events. */
export interface RlStepMetrics {
  reward: number;
  reward_std_dev: number;
  loss: number;
  grad_norm: number;
  entropy: number;
  learning_rate: number;
  num_groups_trainable: number;
  num_groups_skipped: number;
  /** Trajectories trained on (a non-zero advantage and a trainable turn). */
  num_trajectories_trained: number;
  /** Trajectories left out because none of their turns could be trained (no logprobs while
   * `allowTrainingWithoutLogprobs` is false, or longer than `maxSequenceLength`). */
  num_trajectories_dropped: number;
  num_trainable_tokens: number;
  num_tokens: number;
  tokens_per_second: number;
  gradient_step: number;
  /** Mean KL (k1) of the trained tokens from the reference, when the penalty is on. */
  kl_policy_ref?: number;
}

/** One history of a trajectory as a row of the step. */
export interface RlSequence {
  tokens: number[];
  weights: Uint8Array;
  /** Sampling log-prob per token (NaN where unknown). */
  old: Float32Array;
  /** The trajectory's normalized advantage and weight (set once the batch is known). */
  advantage: number;
  weight: number;
  /** Trained tokens (positions t ≥ 1 with weight). */
  trainable: number;
}

/** A conversation of a trajectory, parsed: which messages train and with which logprobs. */
interface History {
  messages: ChatMessage[];
  /** Indices of the messages trained on. */
  trained: number[];
  /** Sampling log-probs of each message (null: unknown). */
  old: (number[] | null)[];
  tools: readonly Record<string, unknown>[] | undefined;
}

interface Parsed {
  histories: History[];
  reward: number;
}

/** `allowTrainingWithoutLogprobs`, as the three states it has. */
type WithoutLogprobs = "drop" | "train" | "choices";

function parseHistory(
  items: unknown,
  toolsRaw: unknown,
  where: string,
  without: WithoutLogprobs,
): History {
  if (!Array.isArray(items)) {
    throw new TrainingInputError(`${where}: messages_and_choices must be an array`);
  }
  const messages: ChatMessage[] = [];
  const trained: number[] = [];
  const old: (number[] | null)[] = [];
  let choices = 0;
  items.forEach((item, j) => {
    const at = `${where} item ${j}`;
    if (typeof item !== "object" || item === null) {
      throw new TrainingInputError(
        `${at}: expected a message (with role) or a choice (with message)`,
      );
    }
    const it = item as Record<string, unknown>;
    if ("role" in it) {
      const message = toChatMessage(it, at);
      if (message.role === "assistant" && without === "train") trained.push(messages.length);
      messages.push(message);
      old.push(null);
      return;
    }
    if (!("message" in it)) {
      throw new TrainingInputError(
        `${at}: expected a message (with role) or a choice (with message)`,
      );
    }
    const message = toChatMessage(it["message"], at);
    if (message.role !== "assistant") {
      throw new TrainingInputError(`${at}: a choice's message must have role assistant`);
    }
    choices++;
    const content = (it["logprobs"] as { content?: unknown } | null | undefined)?.content;
    const logprobs =
      Array.isArray(content) &&
      content.length > 0 &&
      content.every((c) => typeof (c as { logprob?: unknown })?.logprob === "number")
        ? content.map((c) => (c as { logprob: number }).logprob)
        : null;
    if (logprobs || without !== "drop") trained.push(messages.length);
    messages.push(message);
    old.push(logprobs);
  });
  if (choices === 0 && without !== "train") {
    throw new TrainingInputError(`${where}: no trainable assistant turn (no choice item)`);
  }
  // Nothing after the last trained turn is learned from: the history ends there.
  const last = trained.at(-1);
  return {
    messages: last === undefined ? [] : messages.slice(0, last + 1),
    trained,
    old,
    tools: Array.isArray(toolsRaw) ? (toolsRaw as Record<string, unknown>[]) : undefined,
  };
}

function parseTrajectory(raw: unknown, where: string, without: WithoutLogprobs): Parsed {
  if (typeof raw !== "object" || raw === null) {
    throw new TrainingInputError(`${where}: a trajectory must be an object`);
  }
  const t = raw as Record<string, unknown>;
  const reward = t["reward"] ?? 0;
  if (typeof reward !== "number" || !Number.isFinite(reward)) {
    throw new TrainingInputError(`${where}: reward must be a finite number`);
  }
  const histories = [parseHistory(t["messages_and_choices"], t["tools"], where, without)];
  const more = t["additional_histories"];
  if (Array.isArray(more)) {
    more.forEach((h, k) => {
      const history = (h ?? {}) as Record<string, unknown>;
      histories.push(
        parseHistory(
          history["messages_and_choices"],
          history["tools"],
          `${where} additional history ${k}`,
          without,
        ),
      );
    });
  }
  return { histories, reward };
}

function mean(xs: readonly number[]): number {
  return xs.reduce((a, b) => a + b, 0) / Math.max(1, xs.length);
}

function std(xs: readonly number[]): number {
  const m = mean(xs);
  return Math.sqrt(mean(xs.map((x) => (x - m) ** 2)));
}

/**
 * One RL optimizer step over trajectory groups, as ART's trainer computes it:
 * 1. per group, A = reward − mean (÷ (std + 1e-6) with `scaleRewards`); a trajectory with A = 0
 *    teaches nothing and is left out, so a group of equal rewards is skipped;
 * 2. each trajectory weighs 1 / its trained tokens, normalized to mean 1 over the batch's trained
 *    tokens; `advantageBalance` shrinks one sign; advantages are divided by the batch's mean of
 *    |A|·weight;
 * 3. per token, ρ = π/π_sampling at `importanceSamplingLevel` (a turn without logprobs has ρ = 1),
 *    capped, masked, and A shaped by τ and the KL penalty; the loss is `lossFn`'s, scaled by
 *    truncated importance sampling and the weight;
 * 4. each history's loss is its tokens' sum over its trained-token count, and the step's loss the
 *    mean over histories: ART's GPU runtime takes one optimizer step per history, this takes one
 *    for all of them on the same gradients' mean.
 * The trained turns are tokenized exactly as the chat template renders them; a choice's logprobs
 * are used when their count matches its content tokens. Throws `TrainingInputError` on bad input.
 */
export function trainRlStep(
  trainer: LoraTrainer,
  groups: readonly TrajectoryGroup[],
  learningRate: number,
  config: RlConfig = {},
): RlStepMetrics {
  const t0 = performance.now();
  if (!Array.isArray(groups) || groups.length === 0) {
    throw new TrainingInputError("no trajectory groups");
  }
  const without: WithoutLogprobs =
    config.allowTrainingWithoutLogprobs === undefined
      ? "choices"
      : config.allowTrainingWithoutLogprobs
        ? "train"
        : "drop";
  const maxLen = trainer.model.config.maxPositions;
  const parsed = groups.map((group, g) => {
    const trajectories = (group as { trajectories?: unknown })?.trajectories;
    if (!Array.isArray(trajectories)) {
      throw new TrainingInputError(`group ${g}: trajectories must be an array`);
    }
    return trajectories.map((t, i) => parseTrajectory(t, `group ${g} trajectory ${i}`, without));
  });
  const allRewards = parsed.flat().map((t) => t.reward);
  const groupStds = parsed.map((g) => std(g.map((t) => t.reward)));
  const scale = config.scaleRewards ?? true;
  let skipped = 0;
  let dropped = 0;
  let trained = 0;
  const sequences: RlSequence[] = [];
  parsed.forEach((group, g) => {
    const rewards = group.map((t) => t.reward);
    const s = groupStds[g]!;
    if (group.length < 2 || s === 0) {
      skipped++;
      return;
    }
    const m = mean(rewards);
    for (const trajectory of group) {
      const advantage = scale ? (trajectory.reward - m) / (s + 1e-6) : trajectory.reward - m;
      if (advantage === 0) continue;
      const rows = trajectory.histories
        .map((h) => tokenize(trainer, h, maxLen, config.maxSequenceLength))
        .filter((row): row is RlSequence => row !== null && row.trainable > 0);
      const tokens = rows.reduce((n, r) => n + r.trainable, 0);
      if (tokens === 0) {
        dropped++;
        continue;
      }
      trained++;
      for (const row of rows) {
        row.advantage = advantage;
        row.weight = 1 / (tokens + 1e-6);
        sequences.push(row);
      }
    }
  });
  normalizeBatch(sequences, config.advantageBalance ?? 0);
  let trainable = 0;
  let numTokens = 0;
  for (const s of sequences) {
    numTokens += s.tokens.length;
    trainable += s.trainable;
  }
  let loss = 0;
  let entropySum = 0;
  let klSum = 0;
  if (trainable > 0) {
    const objective = rlObjective(config, sequences.length);
    const plan = microBatchBudget(
      trainer.model.config,
      trainer.kernels,
      sequences,
      config.microBatchTokens ?? 4096,
      trainer.model.storage,
    );
    const klOn = (config.klPenaltyCoef ?? 0) !== 0;
    for (const micro of microBatches(sequences, plan.tokens)) {
      const batch = packBatch(micro, maxLen);
      const T = batch.seqLen;
      const rows = {
        T,
        micro,
        sampled: new Float32Array(batch.lossMask.length).fill(Number.NaN),
        reference: klOn ? trainer.referenceLogprobs(batch, config.klReference ?? null) : null,
      };
      micro.forEach((s, b) => {
        for (let t = 0; t + 1 < s.tokens.length && t < T; t++)
          rows.sampled[b * T + t] = s.old[t + 1]!;
      });
      const mask = batch.lossMask;
      let kl = 0;
      const result = trainer.backward(batch, {
        entropy: true,
        maskedRowsOnly: true,
        recompute: plan.recompute,
        objective: (logprobs) => {
          const out = objective(logprobs, mask, rows);
          kl = out.kl;
          return out;
        },
      });
      loss += result.loss;
      klSum += kl;
      const ent = result.entropy!;
      for (let r = 0; r < mask.length; r++) entropySum += mask[r]! * ent[r]!;
    }
  }
  const { gradNorm } = trainable > 0 ? trainer.step(learningRate) : { gradNorm: 0 };
  const seconds = (performance.now() - t0) / 1000;
  return {
    reward: mean(allRewards),
    reward_std_dev: mean(groupStds),
    loss,
    grad_norm: gradNorm,
    entropy: trainable > 0 ? entropySum / trainable : 0,
    learning_rate: learningRate,
    num_groups_trainable: groups.length - skipped,
    num_groups_skipped: skipped,
    num_trajectories_trained: trained,
    num_trajectories_dropped: dropped,
    num_trainable_tokens: trainable,
    num_tokens: numTokens,
    tokens_per_second: seconds > 0 ? numTokens / seconds : 0,
    gradient_step: trainer.stepCount,
    ...((config.klPenaltyCoef ?? 0) !== 0
      ? { kl_policy_ref: trainable > 0 ? klSum / trainable : 0 }
      : {}),
  };
}

/** A history as a row: its tokens, the trained positions and their sampling log-probs; null when
 * it is longer than `maxSequenceLength`. */
function tokenize(
  trainer: LoraTrainer,
  history: History,
  maxLen: number,
  maxSequenceLength: number | undefined,
): RlSequence | null {
  if (history.trained.length === 0) return null;
  const trained = new Set(history.trained);
  let chat: ReturnType<typeof trainer.model.chat.trainingTokens>;
  try {
    chat = trainer.model.chat.trainingTokens(history.messages, (i) => trained.has(i), {
      tools: history.tools,
    });
  } catch (err) {
    if (err instanceof PromptError) throw new TrainingInputError(err.message);
    throw err;
  }
  if (maxSequenceLength !== undefined && chat.tokens.length > maxSequenceLength) return null;
  const old = new Float32Array(chat.tokens.length).fill(Number.NaN);
  for (const i of history.trained) {
    const lp = history.old[i];
    const turn = chat.turns.get(i);
    if (!lp || !turn) continue;
    const [start, end] = turn;
    const positions: number[] = [];
    for (let p = start; p < end; p++) if (chat.mask[p]) positions.push(p);
    // The template adds an end-of-turn token (no sampled logprob) after the content tokens.
    if (lp.length === positions.length - 1 || lp.length === positions.length) {
      lp.forEach((v, k) => {
        old[positions[k]!] = v;
      });
    }
  }
  const n = Math.min(chat.tokens.length, maxLen);
  const weights = chat.mask.subarray(0, n);
  let trainable = 0;
  for (let t = 1; t < n; t++) trainable += weights[t]!;
  return {
    tokens: chat.tokens.slice(0, n),
    weights,
    old: old.subarray(0, n),
    advantage: 0,
    weight: 0,
    trainable,
  };
}

/** Step 2: weights to mean 1 over the trained tokens, the balance, advantages ÷ mean |A|·weight. */
function normalizeBatch(rows: RlSequence[], balance: number): void {
  let tokens = 0;
  let weightSum = 0;
  for (const r of rows) {
    tokens += r.trainable;
    weightSum += r.trainable * r.weight;
  }
  if (tokens === 0) return;
  const meanWeight = weightSum / tokens;
  let absSum = 0;
  for (const r of rows) {
    r.weight /= meanWeight;
    if (balance > 0 && r.advantage < 0) r.advantage *= 1 - balance;
    else if (balance < 0 && r.advantage > 0) r.advantage *= 1 + balance;
    absSum += r.trainable * Math.abs(r.advantage) * r.weight;
  }
  const meanAbs = absSum / tokens;
  if (meanAbs > 0) for (const r of rows) r.advantage /= meanAbs;
}

/** What the objective of one micro-batch reads besides the log-probs. */
export interface MicroRows {
  T: number;
  micro: readonly RlSequence[];
  /** Sampling log-prob at each position (NaN: unknown). */
  sampled: Float32Array;
  /** The reference policy's log-prob at each position, with the KL penalty on. */
  reference: Float32Array | null;
}

/**
 * Step 3 and 4 for one micro-batch: the loss of `rows` given the learner's log-probs, and its
 * gradient per position (through ρ, which at the sequence levels couples a sequence's tokens).
 */
export function rlObjective(config: RlConfig, histories: number) {
  const lossFn = config.lossFn ?? "cispo";
  const epsilon = config.epsilon ?? (lossFn === "ppo" ? 0.2 : 1);
  const lo = 1 - epsilon;
  const hi = 1 + (config.epsilonHigh ?? (lossFn === "ppo" ? epsilon : 4));
  const level = config.importanceSamplingLevel ?? "token";
  const cap = config.maxImportanceWeight || undefined;
  const tau = config.kimiK2Tau || 0;
  const klCoef = config.klPenaltyCoef || 0;
  const fromSample = config.klPenaltySource === "sample";
  const tisCap = config.truncatedImportanceSampling || undefined;
  const precalculated = config.precalculateLogprobs ?? false;
  return (logprobs: Float32Array, mask: Float32Array, rows: MicroRows) => {
    const grad = new Float32Array(mask.length);
    const { T, sampled, reference } = rows;
    let loss = 0;
    let kl = 0;
    rows.micro.forEach((row, b) => {
      const base = b * T;
      const n = row.trainable;
      if (n === 0) return;
      // The ratio's denominator: the sampler's log-prob, or (unknown, or precalculated) the
      // learner's own, detached, so ρ = 1 there and still carries the gradient.
      const denominator = (r: number) =>
        precalculated || Number.isNaN(sampled[r]!) ? logprobs[r]! : sampled[r]!;
      const klAt = (r: number) => {
        const source = fromSample && !Number.isNaN(sampled[r]!) ? sampled[r]! : logprobs[r]!;
        return source - reference![r]!;
      };
      let diffSum = 0;
      let klRow = 0;
      for (let t = 0; t < T; t++) {
        const r = base + t;
        if (mask[r] === 0) continue;
        diffSum += logprobs[r]! - denominator(r);
        if (reference) klRow += klAt(r);
      }
      kl += klRow;
      const seq = Math.exp(diffSum / n);
      const klMean = klRow / n;
      const scale = 1 / ((n + 1e-18) * histories);
      let shared = 0;
      for (let t = 0; t < T; t++) {
        const r = base + t;
        const m = mask[r]!;
        if (m === 0) continue;
        const lp = logprobs[r]!;
        const diff = lp - denominator(r);
        const own = Math.exp(diff);
        // ρ and its derivatives: by this token's log-prob, and (÷ n) by each of the sequence's.
        let rho: number;
        let dOwn: number;
        let dShared: number;
        if (level === "sequence") [rho, dOwn, dShared] = [seq, 0, seq];
        else if (level === "average") [rho, dOwn, dShared] = [(own + seq) / 2, own / 2, seq / 2];
        else if (level === "geometric_average") {
          rho = Math.sqrt(own) * Math.sqrt(seq);
          [dOwn, dShared] = [rho / 2, rho / 2];
        } else [rho, dOwn, dShared] = [own, own, 0];
        if (cap !== undefined && rho > cap) [rho, dOwn, dShared] = [cap, 0, 0];
        if (config.maskProbRatio && !(rho > lo && rho < hi)) [rho, dOwn, dShared] = [0, 0, 0];
        let a = row.advantage;
        if (tau) a -= tau * diff;
        if (reference && klCoef) a += klCoef * (klMean - klAt(r));
        let tis = 1;
        if (tisCap !== undefined) {
          const ratio = precalculated
            ? Math.exp(lp - (Number.isNaN(sampled[r]!) ? lp : sampled[r]!))
            : rho;
          tis = Math.min(ratio, tisCap);
        }
        const f = tis * row.weight * m * scale;
        if (lossFn === "ppo") {
          const unclipped = rho * a;
          const clipped = Math.min(hi, Math.max(lo, rho)) * a;
          loss += -f * Math.min(unclipped, clipped);
          if (unclipped <= clipped) {
            grad[r] = grad[r]! + -f * a * dOwn;
            shared += -f * a * dShared;
          }
        } else if (lossFn === "cispo") {
          const clipped = Math.min(hi, Math.max(lo, rho));
          loss += -f * clipped * a * lp;
          grad[r] = grad[r]! + -f * clipped * a;
        } else {
          loss += -f * a * lp;
          grad[r] = grad[r]! + -f * a;
        }
      }
      if (shared !== 0) {
        for (let t = 0; t < T; t++)
          if (mask[base + t] !== 0) grad[base + t] = grad[base + t]! + shared / n;
      }
    });
    return { loss, grad, kl };
  };
}
