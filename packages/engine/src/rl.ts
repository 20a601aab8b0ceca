import { type ChatMessage, PromptError } from "./chat.ts";
import type { LoraTrainer } from "./lora-train.ts";
import { microBatches, packBatch } from "./sft.ts";
import { microBatchBudget } from "./train-memory.ts";
import { TrainingInputError, toChatMessage } from "./training-data.ts";

/** CONTRACT §5: `{trajectories, exceptions?, metadata?, metrics?, logs?}`; unknown keys ignored. */
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

export interface RlConfig {
  /** Default 1e-5. */
  learningRate?: number;
  /**
   * `ppo`: −min(ρA, clip(ρ, 1−ε, 1+ε_high)A) per token; `cispo`: −sg(clip(ρ, 1−ε, 1+ε_high))·A·log π;
   * `pg`: −A·log π (REINFORCE with the group baseline). ρ = π/π_sampling from the choice's
   * logprobs; tokens without them use `pg`. Default "ppo".
   */
  lossFn?: RlLoss;
  /** Default 0.2. */
  epsilon?: number;
  /** Upper clip; defaults to `epsilon`. */
  epsilonHigh?: number;
  /**
   * Dual-clip PPO bound for negative advantages: tokens with ρ > dualClip get no gradient, so a
   * stale or misaligned sampling logprob cannot blow up the step. Default 3; ppo only.
   */
  dualClip?: number;
  /** Divide advantages by the group's reward standard deviation. Default true. */
  scaleRewards?: boolean;
  /** Normalise all advantages of the step to mean 0, std 1. Default false. */
  normalizeAdvantages?: boolean;
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
  num_trainable_tokens: number;
  num_tokens: number;
  tokens_per_second: number;
  gradient_step: number;
}

interface RlSequence {
  tokens: number[];
  weights: Uint8Array;
  /** Sampling log-prob per token (NaN where unknown). */
  old: Float32Array;
  advantage: number;
}

interface Parsed {
  messages: ChatMessage[];
  choiceIndices: number[];
  old: (number[] | null)[];
  reward: number;
  tools: readonly Record<string, unknown>[] | undefined;
}

function parseTrajectory(raw: unknown, where: string): Parsed {
  if (typeof raw !== "object" || raw === null) {
    throw new TrainingInputError(`${where}: a trajectory must be an object`);
  }
  const t = raw as Record<string, unknown>;
  const reward = t["reward"];
  if (typeof reward !== "number" || !Number.isFinite(reward)) {
    throw new TrainingInputError(`${where}: reward must be a finite number`);
  }
  const items = t["messages_and_choices"];
  if (!Array.isArray(items)) {
    throw new TrainingInputError(`${where}: messages_and_choices must be an array`);
  }
  const messages: ChatMessage[] = [];
  const choiceIndices: number[] = [];
  const old: (number[] | null)[] = [];
  items.forEach((item, j) => {
    const at = `${where} item ${j}`;
    const it = (item ?? {}) as Record<string, unknown>;
    if ("message" in it && "finish_reason" in it && "index" in it) {
      const message = toChatMessage(it["message"], at);
      if (message.role !== "assistant") {
        throw new TrainingInputError(`${at}: a choice's message must have role assistant`);
      }
      choiceIndices.push(messages.length);
      messages.push(message);
      const content = (it["logprobs"] as { content?: unknown } | null | undefined)?.content;
      old.push(
        Array.isArray(content) &&
          content.every((c) => typeof (c as { logprob?: unknown })?.logprob === "number")
          ? content.map((c) => (c as { logprob: number }).logprob)
          : null,
      );
    } else if ("role" in it) {
      messages.push(toChatMessage(it, at));
      old.push(null);
    } else {
      throw new TrainingInputError(
        `${at}: expected a message (with role) or a choice (with message, finish_reason, index)`,
      );
    }
  });
  if (choiceIndices.length === 0) {
    throw new TrainingInputError(`${where}: no trainable assistant turn (no choice item)`);
  }
  const tools = t["tools"];
  return {
    messages,
    choiceIndices,
    old,
    reward,
    tools: Array.isArray(tools) ? (tools as Record<string, unknown>[]) : undefined,
  };
}

function mean(xs: readonly number[]): number {
  return xs.reduce((a, b) => a + b, 0) / Math.max(1, xs.length);
}

function std(xs: readonly number[]): number {
  const m = mean(xs);
  return Math.sqrt(mean(xs.map((x) => (x - m) ** 2)));
}

/**
 * One RL optimizer step over trajectory groups with group-relative advantages. The trainable
 * turns are re-tokenized exactly as the chat template renders them (content and `<|im_end|>`);
 * a choice's sampling logprobs are used when their count matches its content tokens, else that
 * turn falls back to the `pg` loss. Groups whose rewards are all equal are skipped. The loss is
 * averaged over all trainable tokens. Throws `TrainingInputError` on bad input.
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
  const maxLen = trainer.model.config.maxPositions;
  const parsed = groups.map((group, g) => {
    const trajectories = (group as { trajectories?: unknown })?.trajectories;
    if (!Array.isArray(trajectories) || trajectories.length === 0) {
      throw new TrainingInputError(`group ${g}: trajectories must be a non-empty array`);
    }
    return trajectories.map((t, i) => parseTrajectory(t, `group ${g} trajectory ${i}`));
  });
  const allRewards = parsed.flat().map((t) => t.reward);
  const groupStds = parsed.map((g) => std(g.map((t) => t.reward)));
  let skipped = 0;
  const kept: { trajectory: Parsed; advantage: number }[] = [];
  parsed.forEach((group, g) => {
    const rewards = group.map((t) => t.reward);
    const s = groupStds[g]!;
    if (s === 0) {
      skipped++;
      return;
    }
    const m = mean(rewards);
    for (const t of group) {
      const a = t.reward - m;
      kept.push({ trajectory: t, advantage: config.scaleRewards === false ? a : a / (s + 1e-6) });
    }
  });
  if (config.normalizeAdvantages && kept.length > 0) {
    const advs = kept.map((k) => k.advantage);
    const m = mean(advs);
    const s = std(advs);
    for (const k of kept) k.advantage = (k.advantage - m) / (s + 1e-6);
  }
  const sequences: RlSequence[] = kept.map(({ trajectory, advantage }) => {
    const choices = new Set(trajectory.choiceIndices);
    let chat: ReturnType<typeof trainer.model.chat.trainingTokens>;
    try {
      chat = trainer.model.chat.trainingTokens(trajectory.messages, (i) => choices.has(i), {
        tools: trajectory.tools,
      });
    } catch (err) {
      if (err instanceof PromptError) throw new TrainingInputError(err.message);
      throw err;
    }
    const old = new Float32Array(chat.tokens.length).fill(Number.NaN);
    for (const i of trajectory.choiceIndices) {
      const lp = trajectory.old[i];
      const turn = chat.turns.get(i);
      if (!lp || !turn) continue;
      const [start, end] = turn;
      const positions: number[] = [];
      for (let p = start; p < end; p++) if (chat.mask[p]) positions.push(p);
      // The template adds <|im_end|> (no sampled logprob) after the content tokens.
      if (lp.length === positions.length - 1 || lp.length === positions.length) {
        lp.forEach((v, k) => {
          old[positions[k]!] = v;
        });
      }
    }
    const n = Math.min(chat.tokens.length, maxLen);
    return {
      tokens: chat.tokens.slice(0, n),
      weights: chat.mask.subarray(0, n),
      old: old.subarray(0, n),
      advantage,
    };
  });
  let trainable = 0;
  let numTokens = 0;
  for (const s of sequences) {
    numTokens += s.tokens.length;
    for (let t = 1; t < s.weights.length; t++) trainable += s.weights[t]!;
  }
  const lossFn = config.lossFn ?? "ppo";
  const lo = 1 - (config.epsilon ?? 0.2);
  const hi = 1 + (config.epsilonHigh ?? config.epsilon ?? 0.2);
  const dualClip = config.dualClip ?? 3;
  let loss = 0;
  let entropySum = 0;
  if (trainable > 0) {
    const plan = microBatchBudget(
      trainer.model.config,
      trainer.kernels,
      sequences,
      config.microBatchTokens ?? 4096,
      trainer.model.storage,
    );
    for (const micro of microBatches(sequences, plan.tokens)) {
      const batch = packBatch(micro, maxLen);
      const T = batch.seqLen;
      const adv = new Float32Array(batch.lossMask.length);
      const old = new Float32Array(batch.lossMask.length).fill(Number.NaN);
      micro.forEach((s, b) => {
        for (let t = 0; t + 1 < s.tokens.length; t++) {
          adv[b * T + t] = s.advantage;
          old[b * T + t] = s.old[t + 1]!;
        }
      });
      const mask = batch.lossMask;
      const result = trainer.backward(batch, {
        entropy: true,
        maskedRowsOnly: true,
        recompute: plan.recompute,
        objective: (logprobs) => {
          const grad = new Float32Array(mask.length);
          let l = 0;
          for (let r = 0; r < mask.length; r++) {
            if (mask[r] === 0) continue;
            const a = adv[r]!;
            const lp = logprobs[r]!;
            const o = old[r]!;
            let tokenLoss: number;
            let g: number;
            if (lossFn === "pg" || Number.isNaN(o)) {
              tokenLoss = -a * lp;
              g = -a;
            } else {
              const ratio = Math.exp(lp - o);
              const clipped = Math.min(hi, Math.max(lo, ratio));
              if (lossFn === "cispo") {
                tokenLoss = -clipped * a * lp;
                g = -clipped * a;
              } else {
                const unclippedObj = ratio * a;
                const clippedObj = clipped * a;
                if (a < 0 && ratio > dualClip) {
                  tokenLoss = -dualClip * a;
                  g = 0;
                } else if (unclippedObj <= clippedObj) {
                  tokenLoss = -unclippedObj;
                  g = -unclippedObj; // d(−ρA)/d log π = −ρA
                } else {
                  tokenLoss = -clippedObj;
                  g = 0;
                }
              }
            }
            l += (mask[r]! * tokenLoss) / trainable;
            grad[r] = (mask[r]! * g) / trainable;
          }
          return { loss: l, grad };
        },
      });
      loss += result.loss;
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
    num_trainable_tokens: trainable,
    num_tokens: numTokens,
    tokens_per_second: seconds > 0 ? numTokens / seconds : 0,
    gradient_step: trainer.stepCount,
  };
}
