import { type Kernels, type Workspace, withWorkspace } from "../kernels/types.ts";
import { copyRow } from "../kernels/weight.ts";
import {
  backwardScratch,
  blockPass,
  type LayerActivations,
  layerActivations,
  layerBackward,
  layerForward,
} from "../model/block.ts";
import type { LinearHooks } from "../model/lora.ts";
import type { Model } from "../model/model.ts";
import type { ModelGrads } from "../model/weights.ts";

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
  /**
   * Σ mask over the positions whose target is the most likely token (the argmax of the logits,
   * ties counted as hits): `correct / weight` is the mean token accuracy.
   */
  correct: number;
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
  /**
   * Only the rows with a non-zero loss mask matter (the objective reads their log-probs alone
   * and gives the others no gradient): the head's logits, by far the widest GEMM, are computed
   * at those rows alone, and `tokenLogprobs` is 0 at the others. The loss and gradients are
   * the same (the other rows' logit gradients are exact zeros).
   */
  maskedRowsOnly?: boolean;
  /**
   * Keep only each layer's input through the forward and compute its activations again in the
   * backward, one layer at a time: one more forward of the layers (about half again their
   * compute in a LoRA step) for a fraction of the memory
   * (`trainingMemory`'s `perRowRecompute`). The same bits either way.
   */
  recompute?: boolean;
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
  // Each layer's activations, or (recompute) its input and one set of activation buffers that
  // every layer's forward fills again in the backward.
  const saved: LayerActivations[] = [];
  const inputs: Float32Array[] = [];
  const reused = options.recompute ? layerActivations(pass, x) : null;
  for (let l = 0; l < config.numLayers; l++) {
    const a = reused ?? layerActivations(pass, x);
    a.xIn = x;
    const xOut = ws.f32(R * D);
    layerForward(pass, l, a, xOut);
    if (reused) inputs.push(x);
    else saved.push(a);
    x = xOut;
  }
  const recomputed = reused ? ws.f32(R * D) : null;
  const activationsOf = (l: number): LayerActivations => {
    if (!reused) return saved[l]!;
    reused.xIn = inputs[l]!;
    layerForward(pass, l, reused, recomputed!);
    return reused;
  };
  const hf = ws.f32(R * D);
  const invF = ws.f32(R);
  kernels.rmsNorm(hf, x, weights.norm, R, D, eps, invF);
  const head = weights.lmHead ?? weights.embed;
  // The head's rows: every row, or (maskedRowsOnly) those of non-zero mask, gathered.
  const rows = options.maskedRowsOnly ? maskedRows(batch.lossMask) : null;
  const Rh = rows ? rows.length : R;
  const at = (i: number) => (rows ? rows[i]! : i);
  const hHead = rows ? ws.f32(Rh * D) : hf;
  if (rows) for (let i = 0; i < Rh; i++) hHead.set(hf.subarray(at(i) * D, (at(i) + 1) * D), i * D);
  const logits = ws.f32(Rh * V);
  kernels.matmulNT(logits, hHead, head, Rh, V, D, false, ver);
  // An adapter of the head adds its update to the logits (layer -1: after every layer).
  hooks?.forward(-1, "head", logits, hHead, Rh);

  // Softmax cross-entropy; logits become d(loss)/d(logits) in place.
  let weight = 0;
  for (let r = 0; r < R; r++) weight += batch.lossMask[r]!;
  const norm = weight > 0 ? 1 / weight : 0;
  const tokenLogprobs = new Float32Array(R); // returned: not in the workspace
  const mask = ws.f32(Rh);
  const targetLogits = ws.f32(Rh);
  const rowScale = ws.f32(Rh);
  for (let i = 0; i < Rh; i++) {
    const r = at(i);
    mask[i] = batch.lossMask[r]!;
    targetLogits[i] = logits[i * V + batch.targets[r]!]!;
    rowScale[i] = mask[i]! * norm;
  }
  const rowMax = ws.f32(Rh);
  const rowSum = ws.f32(Rh);
  if (options.objective || options.entropy) rowScale.fill(1);
  kernels.softmaxRows(logits, Rh, V, rowScale, rowMax, rowSum);
  let lossSum = 0;
  let correct = 0;
  for (let i = 0; i < Rh; i++) {
    const logp = targetLogits[i]! - rowMax[i]! - Math.log(rowSum[i]!);
    tokenLogprobs[at(i)] = logp;
    lossSum -= mask[i]! * logp;
    if (targetLogits[i]! >= rowMax[i]!) correct += mask[i]!;
  }
  const result: LossResult = { loss: lossSum * norm, weight, correct, tokenLogprobs };
  if (options.entropy) {
    const entropy = rowEntropy(logits, mask, Rh, V);
    result.entropy = rows ? new Float32Array(R) : entropy;
    if (rows) for (let i = 0; i < Rh; i++) result.entropy[at(i)] = entropy[i]!;
  }
  if (options.objective) {
    // Rows hold probabilities: d(loss)/d(logits) = −g·(onehot − p) per row.
    const { loss, grad } = options.objective(tokenLogprobs);
    result.loss = loss;
    for (let i = 0; i < Rh; i++) rowScale[i] = -grad[at(i)]!;
    scaleRows(logits, rowScale, Rh, V);
  } else if (options.entropy) {
    for (let i = 0; i < Rh; i++) rowScale[i] = mask[i]! * norm;
    scaleRows(logits, rowScale, Rh, V);
  }
  for (let i = 0; i < Rh; i++) {
    const o = i * V + batch.targets[at(i)]!;
    logits[o] = logits[o]! - rowScale[i]!;
  }
  if (!grads && !hooks?.backward) return result;

  const dLogits = logits;
  const dHead = ws.f32(Rh * D);
  kernels.matmulNN(dHead, dLogits, head, Rh, D, V, false, ver);
  hooks?.backward?.(-1, "head", dLogits, hHead, dHead, Rh);
  if (grads) kernels.matmulTN(grads.lmHead ?? grads.embed, dLogits, hHead, V, D, Rh, true);
  const dHf = rows ? ws.f32(R * D) : dHead;
  if (rows) for (let i = 0; i < Rh; i++) dHf.set(dHead.subarray(i * D, (i + 1) * D), at(i) * D);
  const dx = ws.f32(R * D);
  kernels.rmsNormBackward(dx, grads?.norm ?? ws.f32(D), dHf, x, invF, weights.norm, R, D);

  const scratch = backwardScratch(pass);
  for (let l = config.numLayers - 1; l >= 0; l--) {
    // d(x_in) overwrites d(x_out) in place: the backward reads the latter only before.
    layerBackward(
      pass,
      l,
      activationsOf(l),
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

/** The rows of non-zero mask, or null when that is every row or none (then all are computed). */
function maskedRows(mask: Float32Array): Int32Array | null {
  let n = 0;
  for (let r = 0; r < mask.length; r++) if (mask[r] !== 0) n++;
  if (n === 0 || n === mask.length) return null;
  const rows = new Int32Array(n);
  for (let r = 0, i = 0; r < mask.length; r++) if (mask[r] !== 0) rows[i++] = r;
  return rows;
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
