import type { Kernels } from "../kernels/types.ts";
import { defaultKernels } from "../kernels/wasm.ts";
import {
  checkAdapter,
  type LoraAdapter,
  loraHooks,
  loraParameters,
  zerosLikeAdapter,
} from "../model/lora.ts";
import type { Model } from "../model/model.ts";
import { readSafetensors, saveSafetensors, type TensorMap } from "../model/safetensors.ts";
import { AdamW, type AdamWOptions, clipGradients } from "./optim.ts";
import { type LossOptions, type LossResult, lossAndGradients, type TrainBatch } from "./train.ts";

export interface LoraTrainerOptions {
  /** Defaults: β1 0.9, β2 0.999, ε 1e-8, weight decay 0 (the Hugging Face Trainer's). */
  adamW?: AdamWOptions;
  /** Global L2 clip of the adapter gradients; 0 disables. Default 1. */
  maxGradNorm?: number;
  kernels?: Kernels;
}

/**
 * Trains a LoRA adapter on a frozen base model: only A/B get gradients and AdamW moments.
 * Gradients accumulate over `backward` calls until `step` applies them.
 */
export class LoraTrainer {
  readonly model: Model;
  readonly adapter: LoraAdapter;
  readonly grads: LoraAdapter;
  readonly kernels: Kernels;
  readonly maxGradNorm: number;
  private readonly optimizer: AdamW;
  private readonly gradList: Float32Array[];
  private readonly names: string[];

  constructor(model: Model, adapter: LoraAdapter, options: LoraTrainerOptions = {}) {
    checkAdapter(model, adapter);
    this.model = model;
    this.adapter = adapter;
    this.kernels = options.kernels ?? defaultKernels();
    this.maxGradNorm = options.maxGradNorm ?? 1;
    this.grads = zerosLikeAdapter(adapter);
    const params = loraParameters(adapter);
    this.names = params.map((p) => p.name);
    this.gradList = loraParameters(this.grads).map((p) => p.data);
    this.optimizer = new AdamW(
      params.map((p) => ({ data: p.data, decay: true })),
      { beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0, ...options.adamW },
    );
  }

  /** Optimizer steps taken so far (restored with the optimizer state). */
  get stepCount(): number {
    return this.optimizer.stepCount;
  }

  /** Forward + backward of one micro-batch; adds into the adapter gradients. */
  backward(batch: TrainBatch, options: Omit<LossOptions, "hooks"> = {}): LossResult {
    return lossAndGradients(this.model, this.kernels, batch, null, {
      ...options,
      hooks: loraHooks(this.adapter, this.kernels, this.grads),
    });
  }

  /** Forward only, with the adapter (e.g. evaluation loss or log-probs). */
  evaluate(batch: TrainBatch, options: Omit<LossOptions, "hooks"> = {}): LossResult {
    return lossAndGradients(this.model, this.kernels, batch, null, {
      ...options,
      hooks: loraHooks(this.adapter, this.kernels, null),
    });
  }

  /**
   * The token log-probs of `batch` under a reference policy (`reference`, an adapter of the same
   * base, or null for the base model alone), at its masked positions: forward only.
   */
  referenceLogprobs(batch: TrainBatch, reference: LoraAdapter | null): Float32Array {
    let captured = new Float32Array(batch.lossMask.length);
    lossAndGradients(this.model, this.kernels, batch, null, {
      ...(reference ? { hooks: loraHooks(reference, this.kernels, null) } : {}),
      maskedRowsOnly: true,
      objective: (logprobs) => {
        captured = Float32Array.from(logprobs);
        return { loss: 0, grad: new Float32Array(logprobs.length) };
      },
    });
    return captured;
  }

  /** Clips, applies AdamW at `lr`, zeroes the gradients; returns the norm before clipping. */
  step(lr: number): { gradNorm: number } {
    const gradNorm = clipGradients(this.gradList, this.maxGradNorm);
    if (!Number.isFinite(gradNorm)) {
      this.zeroGrad();
      throw new Error("LoRA training: non-finite gradient; the step was not applied");
    }
    this.optimizer.step(this.gradList, lr);
    this.zeroGrad();
    return { gradNorm };
  }

  zeroGrad(): void {
    for (const g of this.gradList) g.fill(0);
  }

  /** AdamW state as safetensors bytes: `{name}.exp_avg`, `{name}.exp_avg_sq`, step in metadata. */
  optimizerStateToBytes(): Uint8Array {
    const { step, m, v } = this.optimizer.getState();
    const tensors: TensorMap = new Map();
    this.names.forEach((name, i) => {
      tensors.set(`${name}.exp_avg`, { shape: [m[i]!.length], data: m[i]! });
      tensors.set(`${name}.exp_avg_sq`, { shape: [v[i]!.length], data: v[i]! });
    });
    return saveSafetensors(tensors, { format: "arbor-adamw", step: String(step) });
  }

  /** Restores what `optimizerStateToBytes` wrote (for the same adapter layout). */
  loadOptimizerState(bytes: Uint8Array): void {
    const { tensors, metadata } = readSafetensors(bytes);
    const step = Number(metadata["step"]);
    if (metadata["format"] !== "arbor-adamw" || !Number.isInteger(step)) {
      throw new Error("optimizer state: not an arbor-adamw safetensors file");
    }
    const get = (name: string) => {
      const t = tensors.get(name);
      if (!t) throw new Error(`optimizer state: missing ${name}`);
      return t.data;
    };
    this.optimizer.setState({
      step,
      m: this.names.map((n) => get(`${n}.exp_avg`)),
      v: this.names.map((n) => get(`${n}.exp_avg_sq`)),
    });
  }
}
