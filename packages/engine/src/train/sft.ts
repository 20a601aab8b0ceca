import type { Kernels } from "../kernels/types.ts";
import { defaultKernels } from "../kernels/wasm.ts";
import { type ChatMessage, PromptError } from "../model/chat.ts";
import {
  checkAdapter,
  createLoraAdapter,
  type LoraAdapter,
  type LoraConfig,
  loraHooks,
} from "../model/lora.ts";
import type { Model } from "../model/model.ts";
import { deriveSeed, Rng } from "../model/rng.ts";
import { LoraTrainer } from "./lora-train.ts";
import { type AdamWOptions, learningRate, type ScheduleKind } from "./optim.ts";
import { lossAndGradients, type TrainBatch } from "./train.ts";
import { microBatchBudget } from "./train-memory.ts";
import { TrainingInputError } from "./training-data.ts";

/** One conversation to learn from (the training package turns dataset lines into these). */
export interface SftExample {
  messages: readonly ChatMessage[];
  /** Tool definitions (OpenAI `tools`) offered in the conversation. */
  tools?: readonly Record<string, unknown>[];
}

export interface SftConfig {
  /** One peak rate for the schedule, or an explicit rate per step. Default 2e-4. */
  learningRate?: number | readonly number[];
  /** Decay after warm-up (ignored for a list of rates). Default "linear". */
  schedule?: ScheduleKind;
  warmupSteps?: number;
  /** Floor of linear/cosine decay, as a fraction of the peak. Default 0. */
  minLrRatio?: number;
  /**
   * Examples per optimizer step, or "auto": pack by `tokensPerStep`, grouping similar lengths
   * (sorted within windows of 256 shuffled examples, then the steps shuffled). Default "auto".
   */
  batchSize?: number | "auto";
  /** Token budget per step for "auto" (padded batch × length). Default 4096. */
  tokensPerStep?: number;
  /** Largest padded micro-batch run at once (gradients accumulate). Default 4096. */
  microBatchTokens?: number;
  /** Default 1. */
  epochs?: number;
  /** Train on every assistant turn, or only the last one. Default "all". */
  assistantTurns?: "all" | "last";
  /** Shuffling (and a fresh adapter's A init). Default 0. */
  seed?: number;
  /** Default 1. */
  maxGradNorm?: number;
  adamW?: AdamWOptions;
  /** For a fresh adapter. */
  lora?: LoraConfig;
  /** Cut longer examples to this many tokens. Default: the context length. */
  maxLength?: number;
}

/** Per-step metrics, named as the contract's `gradient_step` event fields. */
export interface SftStepMetrics {
  loss: number;
  /** The fraction of the trained tokens whose argmax was the target (before the update). */
  mean_token_accuracy: number;
  grad_norm: number;
  learning_rate: number;
  num_tokens: number;
  num_trainable_tokens: number;
  tokens_per_second: number;
  gradient_step: number;
}

export interface SftProgress {
  /** Steps done so far (= `metrics.gradient_step`). */
  step: number;
  totalSteps: number;
  epoch: number;
  metrics: SftStepMetrics;
  /** The live adapter (copy it, e.g. with `adapterToFiles`, to keep a snapshot). */
  adapter: LoraAdapter;
  /** The AdamW state as bytes, for `resume`. */
  optimizerState(): Uint8Array;
}

export interface SftOptions {
  kernels?: Kernels;
  /** Checked between steps; an abort throws its reason. */
  signal?: AbortSignal;
  /**
   * Called before each step and each micro-batch, synchronously: it throws to stop the job
   * mid-step (a cancel seen through shared memory while this thread computes, when the event
   * loop, and so `signal`, cannot run).
   */
  interrupt?: () => void;
  /** Awaited after every step (save checkpoints, write events). */
  onStep?: (progress: SftProgress) => void | Promise<void>;
  /** Start from this adapter (e.g. a model's latest checkpoint) instead of a fresh one. */
  adapter?: LoraAdapter;
  /**
   * Resume a job: skip the first `step` steps of the (deterministic) plan, continuing from the
   * adapter and optimizer state saved after that step. Gives the same result as an unbroken run.
   */
  resume?: { step: number; adapter: LoraAdapter; optimizerState: Uint8Array };
  /** `planSft`'s result for these same examples and config, when the caller already made it. */
  plan?: SftPlan;
}

export type SftPlan = ReturnType<typeof planSft>;

export interface SftResult {
  adapter: LoraAdapter;
  /** The AdamW state after the last step, as bytes (for a later `resume`). */
  optimizerState(): Uint8Array;
  /** Metrics of the steps run by this call. */
  steps: SftStepMetrics[];
  totalSteps: number;
}

/** One tokenized example: its tokens, a weight per token, and how many of them train. */
export type SftSequence = WeightedSequence & { trainable: number };

interface Prepared {
  sequences: SftSequence[];
  /** Example indices per optimizer step, all epochs. */
  plan: { epoch: number; examples: number[] }[];
}

/** Tokenizes and validates the examples and lays out every step; throws `TrainingInputError`. */
export function planSft(
  model: Model,
  examples: readonly SftExample[],
  config: SftConfig = {},
): { totalSteps: number; stepsPerEpoch: number; prepared: Prepared } {
  if (examples.length === 0) throw new TrainingInputError("sft: no training examples");
  const sequences = sftSequences(model, examples, config);
  const { plan, stepsPerEpoch } = layoutSteps(
    sequences.length,
    (i) => sequences[i]!.tokens.length,
    config,
    "sft",
  );
  return { totalSteps: plan.length, stepsPerEpoch, prepared: { sequences, plan } };
}

/**
 * Every optimizer step of `count` items (examples, or DPO's pairs), all epochs: each epoch
 * shuffled under the seed (one pass in fixed batches keeps the data's order), in fixed batches
 * or (`"auto"`) packed by `tokensPerStep` with `length` (an item's padded tokens) grouping
 * similar lengths. Throws `TrainingInputError` naming `what` for bad epochs or batch sizes.
 */
export function layoutSteps(
  count: number,
  length: (item: number) => number,
  config: Pick<SftConfig, "epochs" | "batchSize" | "tokensPerStep" | "seed">,
  what: string,
): { plan: Prepared["plan"]; stepsPerEpoch: number } {
  const epochs = config.epochs ?? 1;
  if (!Number.isInteger(epochs) || epochs < 1)
    throw new TrainingInputError(`${what}: epochs must be ≥ 1`);
  const batchSize = config.batchSize ?? "auto";
  if (batchSize !== "auto" && (!Number.isInteger(batchSize) || batchSize < 1)) {
    throw new TrainingInputError(`${what}: batch_size must be a positive integer or "auto"`);
  }
  const budget = config.tokensPerStep ?? 4096;
  const plan: Prepared["plan"] = [];
  let stepsPerEpoch = 0;
  for (let epoch = 0; epoch < epochs; epoch++) {
    const order = Array.from({ length: count }, (_, i) => i);
    const rng = new Rng(deriveSeed(config.seed ?? 0, epoch));
    // One pass in fixed batches keeps the data's order (batch i is lines i·B…): a client that
    // runs its own epochs (ART) shuffled it and sends a learning rate per batch. Several passes,
    // or batches the planner packs, shuffle.
    const keepOrder = epochs === 1 && batchSize !== "auto";
    for (let i = order.length - 1; i > 0 && !keepOrder; i--) {
      const j = rng.int(i + 1);
      [order[i], order[j]] = [order[j]!, order[i]!];
    }
    const before = plan.length;
    const steps: number[][] = [];
    if (batchSize === "auto") {
      // Grouped by length within windows of the shuffled order (less padding); the steps are
      // shuffled after.
      for (let w = 0; w < order.length; w += AUTO_WINDOW) {
        const window = order
          .slice(w, w + AUTO_WINDOW)
          .sort((a, b) => length(a) - length(b) || a - b);
        steps.push(...packByTokens(window, length, budget));
      }
      for (let i = steps.length - 1; i > 0; i--) {
        const j = rng.int(i + 1);
        [steps[i], steps[j]] = [steps[j]!, steps[i]!];
      }
    } else {
      for (let i = 0; i < order.length; i += batchSize) steps.push(order.slice(i, i + batchSize));
    }
    for (const examples of steps) plan.push({ epoch, examples });
    stepsPerEpoch = plan.length - before;
  }
  return { plan, stepsPerEpoch };
}

/**
 * The examples as the engine trains on them: tokenized with the chat template, cut to
 * `maxLength`, a weight of 1 on the assistant tokens (`assistantTurns`) and 0 elsewhere;
 * throws `TrainingInputError` naming the example.
 */
export function sftSequences(
  model: Model,
  examples: readonly SftExample[],
  config: Pick<SftConfig, "maxLength" | "assistantTurns"> = {},
): SftSequence[] {
  const maxLen = Math.min(config.maxLength ?? model.config.maxPositions, model.config.maxPositions);
  const turns = config.assistantTurns ?? "all";
  const sequences = examples.map((example, i) => {
    const { messages } = example;
    let last = -1;
    messages.forEach((m, j) => {
      if (m.role === "assistant") last = j;
    });
    if (last < 0) throw new TrainingInputError(`example ${i}: no assistant message to train on`);
    let chat: ReturnType<Model["chat"]["trainingTokens"]>;
    try {
      chat = model.chat.trainingTokens(messages, (j) => turns === "all" || j === last, {
        tools: example.tools,
      });
    } catch (err) {
      if (err instanceof PromptError) throw new TrainingInputError(`example ${i}: ${err.message}`);
      throw err;
    }
    const tokens = chat.tokens.slice(0, maxLen);
    const weights = chat.mask.subarray(0, tokens.length);
    let trainable = 0;
    for (let t = 1; t < weights.length; t++) trainable += weights[t]!;
    return { tokens, weights, trainable };
  });
  return sequences;
}

/**
 * The adapter a training run steps (the resumed one, the one given, or a fresh one from
 * `config.lora` and `seed`) and its trainer: AdamW with clipping, its state restored on a resume.
 */
export function loraTrainer(
  model: Model,
  config: Pick<SftConfig, "lora" | "seed" | "adamW" | "maxGradNorm">,
  options: Pick<SftOptions, "kernels" | "adapter" | "resume">,
): { adapter: LoraAdapter; trainer: LoraTrainer } {
  const adapter =
    options.resume?.adapter ??
    options.adapter ??
    createLoraAdapter(model, config.lora, config.seed ?? 0);
  const trainer = new LoraTrainer(model, adapter, {
    ...(config.adamW ? { adamW: config.adamW } : {}),
    maxGradNorm: config.maxGradNorm ?? 1,
    ...(options.kernels ? { kernels: options.kernels } : {}),
  });
  if (options.resume) trainer.loadOptimizerState(options.resume.optimizerState);
  return { adapter, trainer };
}

/**
 * Supervised fine-tuning of a LoRA adapter on chat examples: cross-entropy on the assistant
 * tokens (all turns or the last), averaged over the step's trainable tokens; AdamW with
 * clipping and the learning-rate schedule; deterministic under `seed`.
 */
export async function trainSft(
  model: Model,
  examples: readonly SftExample[],
  config: SftConfig = {},
  options: SftOptions = {},
): Promise<SftResult> {
  const { totalSteps, prepared } = options.plan ?? planSft(model, examples, config);
  const start = options.resume?.step ?? 0;
  if (!Number.isInteger(start) || start < 0 || start > totalSteps) {
    throw new TrainingInputError(`sft: cannot resume at step ${start} of ${totalSteps}`);
  }
  const { adapter, trainer } = loraTrainer(model, config, options);
  const lr = config.learningRate ?? 2e-4;
  const schedule = {
    kind: config.schedule ?? "linear",
    peak: typeof lr === "number" ? lr : 0,
    warmupSteps: config.warmupSteps ?? 0,
    totalSteps,
    minRatio: config.minLrRatio ?? 0,
    ...(typeof lr === "number" ? {} : { values: lr }),
  };
  if (typeof lr !== "number" && lr.length !== totalSteps) {
    throw new TrainingInputError(
      `sft: learning_rate has ${lr.length} values for ${totalSteps} batches: give one value per batch (optimizer step), or one number`,
    );
  }
  const micro = microBatchBudget(
    model.config,
    trainer.kernels,
    prepared.sequences,
    config.microBatchTokens ?? 4096,
    model.storage,
  );
  const steps: SftStepMetrics[] = [];
  for (let step = start; step < totalSteps; step++) {
    options.signal?.throwIfAborted();
    options.interrupt?.();
    const t0 = performance.now();
    const { epoch, examples: indices } = prepared.plan[step]!;
    const seqs = indices.map((i) => prepared.sequences[i]!);
    let trainable = 0;
    let tokens = 0;
    for (const s of seqs) {
      trainable += s.trainable;
      tokens += s.tokens.length;
    }
    let loss = 0;
    let correct = 0;
    for (const batchSeqs of microBatches(seqs, micro.tokens)) {
      options.interrupt?.();
      const batch = packBatch(batchSeqs, model.config.maxPositions);
      const mask = batch.lossMask;
      const result = trainer.backward(batch, {
        maskedRowsOnly: true,
        recompute: micro.recompute,
        objective: (logprobs) => {
          const grad = new Float32Array(mask.length);
          let l = 0;
          if (trainable > 0) {
            for (let r = 0; r < mask.length; r++) {
              if (mask[r] === 0) continue;
              grad[r] = -mask[r]! / trainable;
              l -= (mask[r]! * logprobs[r]!) / trainable;
            }
          }
          return { loss: l, grad };
        },
      });
      loss += result.loss;
      correct += result.correct;
    }
    const rate = learningRate(schedule, step);
    const { gradNorm } = trainer.step(rate);
    const seconds = (performance.now() - t0) / 1000;
    const metrics: SftStepMetrics = {
      loss,
      mean_token_accuracy: trainable > 0 ? correct / trainable : 0,
      grad_norm: gradNorm,
      learning_rate: rate,
      num_tokens: tokens,
      num_trainable_tokens: trainable,
      tokens_per_second: seconds > 0 ? tokens / seconds : 0,
      gradient_step: step + 1,
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

/** What `evaluateSft` measures, named as the contract's `validation` event fields. */
export interface SftEvalMetrics {
  /** Mean cross-entropy per trained token over every sequence (each token weighs the same). */
  loss: number;
  /** The fraction of the trained tokens whose most likely token (argmax) is the target. */
  mean_token_accuracy: number;
  num_tokens: number;
  num_trainable_tokens: number;
  num_examples: number;
}

export interface SftEvalOptions {
  kernels?: Kernels;
  /** Largest padded micro-batch run at once, as in training (`SftConfig.microBatchTokens`). */
  microBatchTokens?: number;
  /** Called before each micro-batch, synchronously: it throws to stop (as in `trainSft`). */
  interrupt?: () => void;
}

/**
 * The SFT loss of `adapter` on `sequences` (from `sftSequences`: the training's tokens and
 * mask), with no gradient: forward passes in micro-batches bounded as training's are, the
 * adapter's weights read, never written. The loss is Σ −log p over every trained token of the
 * set ÷ their count, so a set's loss does not depend on how it is cut into micro-batches;
 * on one step's sequences it is that step's training loss.
 */
export function evaluateSft(
  model: Model,
  adapter: LoraAdapter,
  sequences: readonly SftSequence[],
  options: SftEvalOptions = {},
): SftEvalMetrics {
  const kernels = options.kernels ?? defaultKernels();
  checkAdapter(model, adapter);
  const micro = microBatchBudget(
    model.config,
    kernels,
    sequences,
    options.microBatchTokens ?? 4096,
    model.storage,
  );
  const hooks = loraHooks(adapter, kernels, null);
  let trainable = 0;
  let tokens = 0;
  for (const s of sequences) {
    trainable += s.trainable;
    tokens += s.tokens.length;
  }
  let lossSum = 0;
  let correct = 0;
  for (const batchSeqs of microBatches(sequences, micro.tokens)) {
    options.interrupt?.();
    const batch = packBatch(batchSeqs, model.config.maxPositions);
    const mask = batch.lossMask;
    // No gradients and no backward: only each layer's input is kept (`recompute` keeps one set
    // of activation buffers), and the head runs on the trained rows alone.
    const result = lossAndGradients(model, kernels, batch, null, {
      hooks,
      maskedRowsOnly: true,
      recompute: true,
    });
    for (let r = 0; r < mask.length; r++) {
      if (mask[r] !== 0) lossSum -= mask[r]! * result.tokenLogprobs[r]!;
    }
    correct += result.correct;
  }
  return {
    loss: trainable > 0 ? lossSum / trainable : 0,
    mean_token_accuracy: trainable > 0 ? correct / trainable : 0,
    num_tokens: tokens,
    num_trainable_tokens: trainable,
    num_examples: sequences.length,
  };
}

/** Splits a step's sequences into padded micro-batches of at most `budget` tokens (≥ 1 each). */
export function microBatches<T extends { tokens: readonly number[] }>(
  seqs: readonly T[],
  budget: number,
): T[][] {
  return packByTokens(seqs, (s) => s.tokens.length, budget);
}

/** Examples of a shuffled epoch that "auto" batching sorts by length among themselves. */
const AUTO_WINDOW = 256;

/**
 * The one packing rule: items in order, each batch as many as fit `budget` tokens once padded
 * to its longest (count × longest), and at least one.
 */
export function packByTokens<T>(
  items: readonly T[],
  length: (item: T) => number,
  budget: number,
): T[][] {
  const out: T[][] = [];
  let current: T[] = [];
  let longest = 0;
  for (const item of items) {
    const n = length(item);
    if (current.length > 0 && (current.length + 1) * Math.max(longest, n) > budget) {
      out.push(current);
      current = [];
      longest = 0;
    }
    current.push(item);
    longest = Math.max(longest, n);
  }
  if (current.length > 0) out.push(current);
  return out;
}

/** One sequence to train on: tokens and a per-token weight (weight k trains the prediction of token k). */
export interface WeightedSequence {
  tokens: readonly number[];
  weights: ArrayLike<number>;
}

/**
 * Stacks sequences into one right-padded batch: position t predicts token t+1 with the weight
 * of token t+1. Sequences longer than `maxLen` tokens are cut to their first `maxLen`.
 */
export function packBatch(sequences: readonly WeightedSequence[], maxLen: number): TrainBatch {
  const lengths = sequences.map((s) => Math.min(s.tokens.length, maxLen));
  const T = Math.max(1, ...lengths.map((n) => n - 1));
  const B = sequences.length;
  const inputs = new Int32Array(B * T);
  const targets = new Int32Array(B * T);
  const lossMask = new Float32Array(B * T);
  sequences.forEach((s, b) => {
    const n = lengths[b]!;
    for (let t = 0; t + 1 < n; t++) {
      inputs[b * T + t] = s.tokens[t]!;
      targets[b * T + t] = s.tokens[t + 1]!;
      lossMask[b * T + t] = s.weights[t + 1]!;
    }
  });
  return { batchSize: B, seqLen: T, inputs, targets, lossMask };
}
