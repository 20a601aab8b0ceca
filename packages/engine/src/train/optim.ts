import type { Kernels } from "../kernels/types.ts";
import type { Model } from "../model/model.ts";
import { type ModelGrads, parameters, zerosLike } from "../model/weights.ts";
import { type LossResult, lossAndGradients, type TrainBatch } from "./train.ts";

export type ScheduleKind = "constant" | "linear" | "cosine";

export interface LrSchedule {
  kind: ScheduleKind;
  peak: number;
  warmupSteps: number;
  totalSteps: number;
  /** The floor, as a fraction of the peak, that linear and cosine decay towards. */
  minRatio?: number;
  /** An explicit per-step list; overrides everything else (the last value holds after its end). */
  values?: readonly number[];
}

/** Linear warm-up to the peak, then constant, linear or cosine decay to peak·minRatio. */
export function learningRate(schedule: LrSchedule, step: number): number {
  const { peak, warmupSteps, totalSteps, kind } = schedule;
  const values = schedule.values;
  if (values && values.length > 0) return values[Math.min(Math.max(0, step), values.length - 1)]!;
  if (warmupSteps > 0 && step < warmupSteps) return (peak * (step + 1)) / warmupSteps;
  if (kind === "constant") return peak;
  const min = peak * (schedule.minRatio ?? 0);
  const span = Math.max(1, totalSteps - warmupSteps);
  const progress = Math.min(1, Math.max(0, (step - warmupSteps) / span));
  const factor = kind === "linear" ? 1 - progress : 0.5 * (1 + Math.cos(Math.PI * progress));
  return min + (peak - min) * factor;
}

export interface AdamWOptions {
  beta1?: number;
  beta2?: number;
  eps?: number;
  weightDecay?: number;
}

/** AdamW over flat Float32Arrays; decay only touches matrices (not norms). */
export class AdamW {
  private readonly m: Float32Array[];
  private readonly v: Float32Array[];
  private t = 0;
  readonly beta1: number;
  readonly beta2: number;
  readonly eps: number;
  readonly weightDecay: number;
  private readonly params: { data: Float32Array; decay: boolean }[];

  constructor(params: { data: Float32Array; decay: boolean }[], options: AdamWOptions = {}) {
    this.params = params;
    this.beta1 = options.beta1 ?? 0.9;
    this.beta2 = options.beta2 ?? 0.95;
    this.eps = options.eps ?? 1e-8;
    this.weightDecay = options.weightDecay ?? 0.1;
    this.m = params.map((p) => new Float32Array(p.data.length));
    this.v = params.map((p) => new Float32Array(p.data.length));
  }

  get stepCount(): number {
    return this.t;
  }

  /** The moments (live arrays, in parameter order) and the step count, for checkpoints. */
  getState(): { step: number; m: Float32Array[]; v: Float32Array[] } {
    return { step: this.t, m: this.m, v: this.v };
  }

  /** Restores moments and step count saved by `getState` (shapes must match). */
  setState(state: { step: number; m: readonly Float32Array[]; v: readonly Float32Array[] }): void {
    if (state.m.length !== this.m.length || state.v.length !== this.v.length) {
      throw new Error("AdamW: state has a different number of parameters");
    }
    state.m.forEach((m, i) => {
      if (m.length !== this.m[i]!.length || state.v[i]!.length !== this.v[i]!.length) {
        throw new Error(`AdamW: state tensor ${i} has a different size`);
      }
      this.m[i]!.set(m);
      this.v[i]!.set(state.v[i]!);
    });
    this.t = state.step;
  }

  step(grads: Float32Array[], lr: number): void {
    this.t++;
    const { beta1, beta2, eps } = this;
    const c1 = 1 - beta1 ** this.t;
    const c2 = 1 - beta2 ** this.t;
    this.params.forEach((p, index) => {
      const w = p.data;
      const g = grads[index]!;
      const m = this.m[index]!;
      const v = this.v[index]!;
      const decay = p.decay ? 1 - lr * this.weightDecay : 1;
      for (let i = 0; i < w.length; i++) {
        const gi = g[i]!;
        const mi = beta1 * m[i]! + (1 - beta1) * gi;
        const vi = beta2 * v[i]! + (1 - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        w[i] = w[i]! * decay - (lr * (mi / c1)) / (Math.sqrt(vi / c2) + eps);
      }
    });
  }
}

/** Scales gradients in place so their global L2 norm is at most maxNorm; returns the norm before. */
export function clipGradients(grads: Float32Array[], maxNorm: number): number {
  let sq = 0;
  for (const g of grads) for (let i = 0; i < g.length; i++) sq += g[i]! * g[i]!;
  const norm = Math.sqrt(sq);
  if (maxNorm > 0 && norm > maxNorm) {
    const s = maxNorm / (norm + 1e-6);
    for (const g of grads) for (let i = 0; i < g.length; i++) g[i] = g[i]! * s;
  }
  return norm;
}

export interface TrainerOptions {
  schedule: LrSchedule;
  adamW?: AdamWOptions;
  maxGradNorm?: number;
}

export interface StepResult extends LossResult {
  step: number;
  lr: number;
  gradNorm: number;
}

/**
 * Full-parameter training of a model: one `step` = forward, backward, clip, AdamW. It updates
 * the weights in place, so it needs them as plain F32 arrays (a model from `loadModel` without
 * kernels, or `randomModel`): a model whose weights live packed in the kernels (BF16 or F32,
 * `loadModel(dir, { kernels })`) is refused; LoRA (`LoraTrainer`) trains on those.
 */
export class Trainer {
  readonly grads: ModelGrads;
  private readonly gradList: Float32Array[];
  private readonly optimizer: AdamW;
  readonly model: Model<Float32Array>;
  readonly kernels: Kernels;
  readonly options: TrainerOptions;

  constructor(model: Model<Float32Array>, kernels: Kernels, options: TrainerOptions) {
    this.model = model;
    this.kernels = kernels;
    this.options = options;
    const params = parameters(model.config, model.weights);
    if (params.some((p) => !(p.data instanceof Float32Array))) {
      throw new Error(
        "full fine-tuning needs the weights as plain F32 arrays; this model keeps them packed in the kernels (train a LoRA adapter, or load the model without kernels)",
      );
    }
    this.grads = zerosLike(model.weights);
    this.gradList = parameters(model.config, this.grads).map((p) => p.data);
    this.optimizer = new AdamW(
      params.map((p) => ({ data: p.data, decay: p.shape.length === 2 })),
      options.adamW,
    );
  }

  step(batch: TrainBatch): StepResult {
    for (const g of this.gradList) g.fill(0);
    const result = lossAndGradients(this.model, this.kernels, batch, this.grads);
    const gradNorm = clipGradients(this.gradList, this.options.maxGradNorm ?? 1);
    const step = this.optimizer.stepCount;
    const lr = learningRate(this.options.schedule, step);
    this.optimizer.step(this.gradList, lr);
    this.model.version++;
    return { ...result, step: step + 1, lr, gradNorm };
  }
}
