import {
  backwardScratch,
  blockPass,
  type LayerActivations,
  layerActivations,
  layerBackward,
  layerForward,
} from "./block.ts";
import { type Kernels, type Workspace, withWorkspace } from "./kernels/types.ts";
import type { LinearHooks } from "./lora.ts";
import type { Model } from "./model.ts";
import { copyRow, type ModelGrads } from "./weights.ts";

/** B sequences of T tokens, row-major; a target and a loss weight per position. */
export interface TrainBatch {
  batchSize: number;
  seqLen: number;
  inputs: Int32Array;
  targets: Int32Array;
  /** Per-token loss weight (0 = ignore, e.g. padding or non-assistant tokens). */
  lossMask: Float32Array;
}

export interface LossResult {
  /** Mean cross-entropy over the weighted tokens. */
  loss: number;
  /** Sum of the loss weights (the number of trained tokens for a 0/1 mask). */
  weight: number;
  /** log p(target) at every position, for policy-gradient objectives. */
  tokenLogprobs: Float32Array;
  /** Entropy of the predicted distribution at positions with a non-zero mask (when asked for). */
  entropy?: Float32Array;
}

/** Extras for adapters and custom objectives (all optional). */
export interface LossOptions {
  /** Adds to every base linear (e.g. LoRA); with `backward`, base gradients may be skipped. */
  hooks?: LinearHooks;
  /**
   * A custom objective of the token log-probs: returns the loss and d(loss)/d(log p) per
   * position. Replaces the masked mean cross-entropy (the mask then only selects entropy rows).
   */
  objective?: (tokenLogprobs: Float32Array) => { loss: number; grad: Float32Array };
  /** Compute the entropy at masked positions. */
  entropy?: boolean;
}

/**
 * Forward with saved activations, then backward: adds d(loss)/d(weight) into `grads` and
 * returns the loss. The loss is Σ mask·(−log p(target)) / Σ mask.
 */
export function lossAndGradients(
  model: Model,
  kernels: Kernels,
  batch: TrainBatch,
  grads: ModelGrads | null,
  options: LossOptions = {},
): LossResult {
  return withWorkspace(kernels, (ws) =>
    lossAndGradientsIn(ws, model, kernels, batch, grads, options),
  );
}

function lossAndGradientsIn(
  ws: Workspace,
  model: Model,
  kernels: Kernels,
  batch: TrainBatch,
  grads: ModelGrads | null,
  options: LossOptions = {},
): LossResult {
  const hooks = options.hooks;
  const { config, weights } = model;
  const B = batch.batchSize;
  const T = batch.seqLen;
  const R = B * T;
  const D = config.hiddenSize;
  const { numHeads: H, numKvHeads: KV, headDim: hd } = config;
  const V = config.vocabSize;
  const eps = config.rmsNormEps;
  const ver = model.version;
  if (T > config.maxPositions) throw new Error("train: sequence longer than the context length");

  let x = ws.f32(R * D);
  for (let r = 0; r < R; r++) {
    const token = batch.inputs[r]!;
    copyRow(weights.embed, D, token, x, r * D);
  }
  const positions = new Int32Array(R);
  for (let r = 0; r < R; r++) positions[r] = r % T;
  // B sequences of T rows, each attending causally to its own.
  const pass = blockPass(
    model,
    kernels,
    ws,
    positions,
    (_, a) => kernels.attention(a.att, a.q, a.k, a.v, T, 0, H, KV, hd, B),
    hooks,
  );
  const saved: LayerActivations[] = [];
  for (let l = 0; l < config.numLayers; l++) {
    const a = layerActivations(pass, x);
    const xOut = ws.f32(R * D);
    layerForward(pass, l, a, xOut);
    saved.push(a);
    x = xOut;
  }
  const hf = ws.f32(R * D);
  const invF = ws.f32(R);
  kernels.rmsNorm(hf, x, weights.norm, R, D, eps, invF);
  const head = weights.lmHead ?? weights.embed;
  const logits = ws.f32(R * V);
  kernels.matmulNT(logits, hf, head, R, V, D, false, ver);

  // Softmax cross-entropy; logits become d(loss)/d(logits) in place.
  let weight = 0;
  for (let r = 0; r < R; r++) weight += batch.lossMask[r]!;
  const norm = weight > 0 ? 1 / weight : 0;
  const tokenLogprobs = new Float32Array(R); // returned: not in the workspace
  const targetLogits = ws.f32(R);
  const rowScale = ws.f32(R);
  for (let r = 0; r < R; r++) {
    targetLogits[r] = logits[r * V + batch.targets[r]!]!;
    rowScale[r] = batch.lossMask[r]! * norm;
  }
  const rowMax = ws.f32(R);
  const rowSum = ws.f32(R);
  if (options.objective || options.entropy) rowScale.fill(1);
  kernels.softmaxRows(logits, R, V, rowScale, rowMax, rowSum);
  let lossSum = 0;
  for (let r = 0; r < R; r++) {
    const logp = targetLogits[r]! - rowMax[r]! - Math.log(rowSum[r]!);
    tokenLogprobs[r] = logp;
    lossSum -= batch.lossMask[r]! * logp;
  }
  const result: LossResult = { loss: lossSum * norm, weight, tokenLogprobs };
  if (options.entropy) result.entropy = rowEntropy(logits, batch.lossMask, R, V);
  if (options.objective) {
    // Rows hold probabilities: d(loss)/d(logits) = −g·(onehot − p) per row.
    const { loss, grad } = options.objective(tokenLogprobs);
    result.loss = loss;
    for (let r = 0; r < R; r++) rowScale[r] = -grad[r]!;
    scaleRows(logits, rowScale, R, V);
  } else if (options.entropy) {
    for (let r = 0; r < R; r++) rowScale[r] = batch.lossMask[r]! * norm;
    scaleRows(logits, rowScale, R, V);
  }
  for (let r = 0; r < R; r++) {
    const o = r * V + batch.targets[r]!;
    logits[o] = logits[o]! - rowScale[r]!;
  }
  if (!grads && !hooks?.backward) return result;

  const dLogits = logits;
  const dHf = ws.f32(R * D);
  kernels.matmulNN(dHf, dLogits, head, R, D, V, false, ver);
  if (grads) kernels.matmulTN(grads.lmHead ?? grads.embed, dLogits, hf, V, D, R, true);
  const dx = ws.f32(R * D);
  kernels.rmsNormBackward(dx, grads?.norm ?? ws.f32(D), dHf, x, invF, weights.norm, R, D);

  const scratch = backwardScratch(pass);
  for (let l = config.numLayers - 1; l >= 0; l--) {
    // d(x_in) overwrites d(x_out) in place: the backward reads the latter only before.
    layerBackward(
      pass,
      l,
      saved[l]!,
      dx,
      dx,
      {
        layer: grads?.layers[l],
        attendBackward: (a, dAtt, dq, dk, dv) =>
          kernels.attentionBackward(dq, dk, dv, a.q, a.k, a.v, dAtt, T, H, KV, hd, B),
      },
      scratch,
    );
  }
  if (!grads) return result;
  for (let r = 0; r < R; r++) {
    const token = batch.inputs[r]!;
    const o = token * D;
    for (let i = 0; i < D; i++) grads.embed[o + i] = grads.embed[o + i]! + dx[r * D + i]!;
  }
  return result;
}

/** −Σ p·log p of each row of probabilities whose mask is non-zero (0 elsewhere). */
function rowEntropy(p: Float32Array, mask: Float32Array, R: number, V: number): Float32Array {
  const out = new Float32Array(R);
  for (let r = 0; r < R; r++) {
    if (mask[r] === 0) continue;
    let h = 0;
    for (let i = r * V; i < (r + 1) * V; i++) {
      const pi = p[i]!;
      if (pi > 0) h -= pi * Math.log(pi);
    }
    out[r] = h;
  }
  return out;
}

function scaleRows(x: Float32Array, scale: Float32Array, R: number, V: number): void {
  for (let r = 0; r < R; r++) {
    const s = scale[r]!;
    const row = x.subarray(r * V, (r + 1) * V);
    if (s === 0) row.fill(0);
    else for (let i = 0; i < V; i++) row[i] = row[i]! * s;
  }
}
