import type { Kernels } from "../kernels/types.ts";
import { type ChatMessage, PromptError } from "../model/chat.ts";
import { cloneAdapter, type LoraAdapter } from "../model/lora.ts";
import type { Model } from "../model/model.ts";
import type { LoraTrainer } from "./lora-train.ts";
import { learningRate } from "./optim.ts";
import {
  layoutSteps,
  loraTrainer,
  packBatch,
  packByTokens,
  type SftConfig,
  type SftOptions,
  type SftProgress,
  type SftStepMetrics,
  type WeightedSequence,
} from "./sft.ts";
import { type MicroBatchPlan, microBatchBudget } from "./train-memory.ts";
import { TrainingInputError } from "./training-data.ts";

/**
 * Direct Preference Optimization (Rafailov et al. 2023) of a LoRA adapter, ADR 69: for a prompt
 * and two answers, the chosen (c) and the rejected (r), the loss is
 * −log σ(β·((π_c − ref_c) − (π_r − ref_r))), where π and ref are the summed log-probabilities of
 * an answer's tokens under the policy (base + adapter) and under the frozen reference. Only the
 * policy gets gradients: d loss/d π_c = −β·σ(−z), d loss/d π_r = +β·σ(−z), a weight per sequence
 * on the sum of its token log-probs, so one forward-and-backward of the pair's two rows (after a
 * forward-only pass of the reference) gives the exact gradient.
 */

/** One preference pair (OpenAI's DPO line: `input.messages`, `preferred_output`,
 * `non_preferred_output`), as the training package reads it. */
export interface DpoPair {
  /** The conversation before the answer (the prompt). */
  messages: readonly ChatMessage[];
  tools?: readonly Record<string, unknown>[];
  /** The preferred answer: an assistant message. */
  chosen: ChatMessage;
  /** The non-preferred answer: an assistant message. */
  rejected: ChatMessage;
}

/** SFT's schedule, batching and LoRA settings (a pair counts as one example), and β. */
export interface DpoConfig extends Omit<SftConfig, "assistantTurns"> {
  /** β: how far from the reference the policy may move for a margin. Default 0.1. */
  beta?: number;
}

/** SFT's metrics of a step, and DPO's rewards, means over the step's pairs: a reward is
 * β·(π − ref) of an answer, from the policy before the step. */
export interface DpoStepMetrics extends Omit<SftStepMetrics, "mean_token_accuracy"> {
  /** Mean −log σ(β·margin) over the step's pairs. */
  loss: number;
  reward_chosen: number;
  reward_rejected: number;
  /** The share of pairs whose chosen answer has the larger reward. */
  reward_accuracy: number;
  /** Mean of reward_chosen − reward_rejected. */
  reward_margin: number;
}

export interface DpoProgress extends Omit<SftProgress, "metrics"> {
  metrics: DpoStepMetrics;
}

export interface DpoOptions extends Omit<SftOptions, "onStep" | "plan"> {
  onStep?: (progress: DpoProgress) => void | Promise<void>;
  /** `planDpo`'s result for these same pairs and config, when the caller already made it. */
  plan?: DpoPlan;
  /**
   * The reference policy, frozen: an adapter of the same base, or null for the base alone.
   * Default: a copy of `adapter` when one is given (the run's starting point), else the base.
   * A resumed run must be given its starting point again (default: the base).
   */
  reference?: LoraAdapter | null;
}

export interface DpoResult {
  adapter: LoraAdapter;
  optimizerState(): Uint8Array;
  steps: DpoStepMetrics[];
  totalSteps: number;
}

type Row = WeightedSequence & { tokens: number[]; trainable: number };

/** A pair tokenized: each answer after the prompt, as the chat template renders it. */
export interface PreparedPair {
  chosen: Row;
  rejected: Row;
}

export type DpoPlan = ReturnType<typeof planDpo>;

/** A pair's rows padded to its longer answer: what it takes of a micro-batch or a step. */
function pairTokens(pair: PreparedPair): number {
  return 2 * Math.max(pair.chosen.tokens.length, pair.rejected.tokens.length);
}

/**
 * Tokenizes and checks the pairs and lays out every step (as SFT's, a pair for an example);
 * throws `TrainingInputError` naming the pair.
 */
export function planDpo(model: Model, pairs: readonly DpoPair[], config: DpoConfig = {}) {
  if (pairs.length === 0) throw new TrainingInputError("dpo: no preference pairs");
  const beta = config.beta ?? 0.1;
  if (!(beta > 0) || !Number.isFinite(beta))
    throw new TrainingInputError("dpo: beta must be a positive number");
  const maxLen = Math.min(config.maxLength ?? model.config.maxPositions, model.config.maxPositions);
  const prepared = pairs.map((pair, i): PreparedPair => {
    const side = (answer: ChatMessage, name: string): Row => {
      if (answer?.role !== "assistant")
        throw new TrainingInputError(`pair ${i}: the ${name} output must be an assistant message`);
      const messages = [...pair.messages, answer];
      let chat: ReturnType<Model["chat"]["trainingTokens"]>;
      try {
        chat = model.chat.trainingTokens(messages, (j) => j === messages.length - 1, {
          tools: pair.tools,
        });
      } catch (err) {
        if (err instanceof PromptError) throw new TrainingInputError(`pair ${i}: ${err.message}`);
        throw err;
      }
      const tokens = chat.tokens.slice(0, maxLen);
      const weights = chat.mask.subarray(0, tokens.length);
      let trainable = 0;
      for (let t = 1; t < weights.length; t++) trainable += weights[t]!;
      if (trainable === 0) {
        throw new TrainingInputError(
          `pair ${i}: the prompt takes the whole ${maxLen}-token limit, so nothing of the ${name} output is left to compare`,
        );
      }
      return { tokens, weights, trainable };
    };
    return {
      chosen: side(pair.chosen, "preferred"),
      rejected: side(pair.rejected, "non-preferred"),
    };
  });
  const { plan, stepsPerEpoch } = layoutSteps(
    prepared.length,
    (i) => pairTokens(prepared[i]!),
    config,
    "dpo",
  );
  return { totalSteps: plan.length, stepsPerEpoch, beta, prepared: { pairs: prepared, plan } };
}

/**
 * The micro-batches of DPO steps: `budget` rows, within the kernels' memory (as
 * `microBatchBudget`), where a pair's two rows always go together, so the longest pair's
 * padded rows must fit at once.
 */
export function dpoMicroBatchBudget(
  model: Model,
  kernels: Kernels,
  pairs: readonly PreparedPair[],
  budget: number,
): MicroBatchPlan {
  let longest = 0;
  for (const p of pairs) longest = Math.max(longest, pairTokens(p));
  return microBatchBudget(
    model.config,
    kernels,
    [{ tokens: new Array<number>(longest) }],
    budget,
    model.storage,
  );
}

/** What one DPO forward-and-backward over a step's pairs gives. */
export interface DpoBackwardResult {
  /** Mean loss over the pairs. */
  loss: number;
  /** β·(π − ref) of each pair's chosen and rejected answer. */
  chosenRewards: number[];
  rejectedRewards: number[];
}

/**
 * The DPO loss of `pairs` (their mean) and its gradient, added into `trainer.grads`: per
 * micro-batch of whole pairs (at most `micro.tokens` padded rows), a forward-only pass of the
 * reference, then the policy's forward and backward with each answer's summed log-prob weighted
 * by d loss/d π. No optimizer step.
 */
export function dpoBackward(
  trainer: LoraTrainer,
  pairs: readonly PreparedPair[],
  beta: number,
  reference: LoraAdapter | null,
  micro: MicroBatchPlan,
  interrupt?: () => void,
): DpoBackwardResult {
  const n = pairs.length;
  const chosenRewards: number[] = [];
  const rejectedRewards: number[] = [];
  let loss = 0;
  for (const group of packByTokens(pairs, pairTokens, micro.tokens)) {
    interrupt?.();
    // Rows 2k and 2k + 1: pair k's chosen and rejected answers.
    const batch = packBatch(
      group.flatMap((p) => [p.chosen, p.rejected]),
      trainer.model.config.maxPositions,
    );
    const mask = batch.lossMask;
    const T = batch.seqLen;
    const refSums = rowSums(trainer.referenceLogprobs(batch, reference), mask, T);
    trainer.backward(batch, {
      maskedRowsOnly: true,
      recompute: micro.recompute,
      objective: (logprobs) => {
        const sums = rowSums(logprobs, mask, T);
        const grad = new Float32Array(mask.length);
        let l = 0;
        group.forEach((_, k) => {
          const rc = beta * (sums[2 * k]! - refSums[2 * k]!);
          const rr = beta * (sums[2 * k + 1]! - refSums[2 * k + 1]!);
          const z = rc - rr;
          l += softplus(-z) / n;
          // d(−log σ(z))/dz = −σ(−z); dz/dπ_c = β, dz/dπ_r = −β; each token's log-prob
          // enters its answer's sum with its mask weight.
          const g = (beta * sigmoid(-z)) / n;
          for (let t = 0; t < T; t++) {
            const c = 2 * k * T + t;
            const r = (2 * k + 1) * T + t;
            grad[c] = -g * mask[c]!;
            grad[r] = g * mask[r]!;
          }
          chosenRewards.push(rc);
          rejectedRewards.push(rr);
        });
        loss += l;
        return { loss: l, grad };
      },
    });
  }
  return { loss, chosenRewards, rejectedRewards };
}

/** Σ mask · log p over each row of T positions (in doubles). */
function rowSums(logprobs: Float32Array, mask: Float32Array, T: number): number[] {
  const sums: number[] = [];
  for (let b = 0; b * T < mask.length; b++) {
    let s = 0;
    for (let r = b * T; r < (b + 1) * T; r++) if (mask[r] !== 0) s += mask[r]! * logprobs[r]!;
    sums.push(s);
  }
  return sums;
}

/** log(1 + e^x), without overflow. */
function softplus(x: number): number {
  return Math.max(x, 0) + Math.log1p(Math.exp(-Math.abs(x)));
}

function sigmoid(x: number): number {
  return x >= 0 ? 1 / (1 + Math.exp(-x)) : Math.exp(x) / (1 + Math.exp(x));
}

const mean = (xs: readonly number[]) => xs.reduce((a, b) => a + b, 0) / Math.max(1, xs.length);

/**
 * DPO of a LoRA adapter on preference pairs: the loss above, averaged over each step's pairs,
 * against a frozen reference (by default the starting point: the base for a fresh adapter);
 * SFT's optimizer, clipping, schedule, batching, checkpoints and resume.
 */
export async function trainDpo(
  model: Model,
  pairs: readonly DpoPair[],
  config: DpoConfig = {},
  options: DpoOptions = {},
): Promise<DpoResult> {
  const { totalSteps, beta, prepared } = options.plan ?? planDpo(model, pairs, config);
  const start = options.resume?.step ?? 0;
  if (!Number.isInteger(start) || start < 0 || start > totalSteps) {
    throw new TrainingInputError(`dpo: cannot resume at step ${start} of ${totalSteps}`);
  }
  const reference =
    options.reference !== undefined
      ? options.reference
      : options.adapter && !options.resume
        ? cloneAdapter(options.adapter)
        : null;
  const { adapter, trainer } = loraTrainer(model, config, options);
  const lr = config.learningRate ?? 2e-4;
  if (typeof lr !== "number" && lr.length !== totalSteps) {
    throw new TrainingInputError(
      `dpo: learning_rate has ${lr.length} values for ${totalSteps} batches: give one value per batch (optimizer step), or one number`,
    );
  }
  const schedule = {
    kind: config.schedule ?? "linear",
    peak: typeof lr === "number" ? lr : 0,
    warmupSteps: config.warmupSteps ?? 0,
    totalSteps,
    minRatio: config.minLrRatio ?? 0,
    ...(typeof lr === "number" ? {} : { values: lr }),
  };
  const micro = dpoMicroBatchBudget(
    model,
    trainer.kernels,
    prepared.pairs,
    config.microBatchTokens ?? 4096,
  );
  const steps: DpoStepMetrics[] = [];
  for (let step = start; step < totalSteps; step++) {
    options.signal?.throwIfAborted();
    options.interrupt?.();
    const t0 = performance.now();
    const { epoch, examples: indices } = prepared.plan[step]!;
    const stepPairs = indices.map((i) => prepared.pairs[i]!);
    let tokens = 0;
    let trainable = 0;
    for (const p of stepPairs) {
      tokens += p.chosen.tokens.length + p.rejected.tokens.length;
      trainable += p.chosen.trainable + p.rejected.trainable;
    }
    const result = dpoBackward(trainer, stepPairs, beta, reference, micro, options.interrupt);
    const rate = learningRate(schedule, step);
    const { gradNorm } = trainer.step(rate);
    const seconds = (performance.now() - t0) / 1000;
    const margins = result.chosenRewards.map((c, k) => c - result.rejectedRewards[k]!);
    const metrics: DpoStepMetrics = {
      loss: result.loss,
      grad_norm: gradNorm,
      learning_rate: rate,
      num_tokens: tokens,
      num_trainable_tokens: trainable,
      tokens_per_second: seconds > 0 ? tokens / seconds : 0,
      gradient_step: step + 1,
      reward_chosen: mean(result.chosenRewards),
      reward_rejected: mean(result.rejectedRewards),
      reward_accuracy: mean(margins.map((m) => (m > 0 ? 1 : 0))),
      reward_margin: mean(margins),
    };
    steps.push(metrics);
    await options.onStep?.({
      step: step + 1,
      totalSteps,
      epoch,
      metrics,
      adapter,
      optimizerState: () => trainer.optimizerStateToBytes(),
    });
  }
  return { adapter, steps, totalSteps, optimizerState: () => trainer.optimizerStateToBytes() };
}
