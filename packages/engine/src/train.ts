import { type Kernels, type Workspace, withWorkspace } from "./kernels.ts";
import type { LinearHooks } from "./lora.ts";
import { applyRope, type Model } from "./model.ts";
import type { ModelWeights } from "./weights.ts";

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

interface LayerActivations {
  xIn: Float32Array;
  h1: Float32Array;
  inv1: Float32Array;
  q: Float32Array;
  k: Float32Array;
  v: Float32Array;
  att: Float32Array;
  xMid: Float32Array;
  h2: Float32Array;
  inv2: Float32Array;
  gate: Float32Array;
  up: Float32Array;
  act: Float32Array;
}

/**
 * Forward with saved activations, then backward: adds d(loss)/d(weight) into `grads` and
 * returns the loss. The loss is Σ mask·(−log p(target)) / Σ mask.
 */
export function lossAndGradients(
  model: Model,
  kernels: Kernels,
  batch: TrainBatch,
  grads: ModelWeights | null,
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
  grads: ModelWeights | null,
  options: LossOptions = {},
): LossResult {
  const hooks = options.hooks;
  const { config, weights, rope } = model;
  const B = batch.batchSize;
  const T = batch.seqLen;
  const R = B * T;
  const D = config.hiddenSize;
  const hd = config.headDim;
  const H = config.numHeads;
  const KV = config.numKvHeads;
  const qDim = H * hd;
  const kvDim = KV * hd;
  const I = config.intermediateSize;
  const V = config.vocabSize;
  const eps = config.rmsNormEps;
  const ver = model.version;
  if (T > config.maxPositions) throw new Error("train: sequence longer than the context length");

  let x = ws.f32(R * D);
  for (let r = 0; r < R; r++) {
    const token = batch.inputs[r]!;
    x.set(weights.embed.subarray(token * D, token * D + D), r * D);
  }
  const saved: LayerActivations[] = [];
  for (let l = 0; l < config.numLayers; l++) {
    const layer = weights.layers[l]!;
    const a: LayerActivations = {
      xIn: x,
      h1: ws.f32(R * D),
      inv1: ws.f32(R),
      q: ws.f32(R * qDim),
      k: ws.f32(R * kvDim),
      v: ws.f32(R * kvDim),
      att: ws.f32(R * qDim),
      xMid: ws.f32(R * D),
      h2: ws.f32(R * D),
      inv2: ws.f32(R),
      gate: ws.f32(R * I),
      up: ws.f32(R * I),
      act: ws.f32(R * I),
    };
    kernels.rmsNorm(a.h1, x, layer.inputNorm, R, D, eps, a.inv1);
    kernels.matmulNT(a.q, a.h1, layer.q, R, qDim, D, false, ver);
    kernels.matmulNT(a.k, a.h1, layer.k, R, kvDim, D, false, ver);
    kernels.matmulNT(a.v, a.h1, layer.v, R, kvDim, D, false, ver);
    hooks?.forward(l, "q", a.q, a.h1, R);
    hooks?.forward(l, "k", a.k, a.h1, R);
    hooks?.forward(l, "v", a.v, a.h1, R);
    for (let r = 0; r < R; r++) {
      const pos = r % T;
      for (let h = 0; h < H; h++) applyRope(a.q, r * qDim + h * hd, pos, rope);
      for (let h = 0; h < KV; h++) applyRope(a.k, r * kvDim + h * hd, pos, rope);
    }
    kernels.attention(a.att, a.q, a.k, a.v, T, 0, H, KV, hd, B);
    const proj = ws.f32(R * D);
    kernels.matmulNT(proj, a.att, layer.o, R, D, qDim, false, ver);
    hooks?.forward(l, "o", proj, a.att, R);
    for (let i = 0; i < R * D; i++) a.xMid[i] = x[i]! + proj[i]!;
    kernels.rmsNorm(a.h2, a.xMid, layer.postNorm, R, D, eps, a.inv2);
    kernels.matmulNT(a.gate, a.h2, layer.gate, R, I, D, false, ver);
    kernels.matmulNT(a.up, a.h2, layer.up, R, I, D, false, ver);
    hooks?.forward(l, "gate", a.gate, a.h2, R);
    hooks?.forward(l, "up", a.up, a.h2, R);
    kernels.swiglu(a.act, a.gate, a.up, R * I);
    kernels.matmulNT(proj, a.act, layer.down, R, D, I, false, ver);
    hooks?.forward(l, "down", proj, a.act, R);
    const xOut = ws.f32(R * D);
    for (let i = 0; i < R * D; i++) xOut[i] = a.xMid[i]! + proj[i]!;
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
  let dx = ws.f32(R * D);
  const noGrad = ws.f32(D);
  kernels.rmsNormBackward(dx, grads?.norm ?? noGrad, dHf, x, invF, weights.norm, R, D);

  const dH = ws.f32(R * D);
  const dAct = ws.f32(R * I);
  const dGate = ws.f32(R * I);
  const dUp = ws.f32(R * I);
  const dAtt = ws.f32(R * qDim);
  const dq = ws.f32(R * qDim);
  const dk = ws.f32(R * kvDim);
  const dv = ws.f32(R * kvDim);
  for (let l = config.numLayers - 1; l >= 0; l--) {
    const layer = weights.layers[l]!;
    const g = grads?.layers[l];
    const a = saved[l]!;
    // MLP: x_out = x_mid + down(silu(gate) * up)
    kernels.matmulNN(dAct, dx, layer.down, R, I, D, false, ver);
    hooks?.backward?.(l, "down", dx, a.act, dAct, R);
    if (g) kernels.matmulTN(g.down, dx, a.act, D, I, R, true);
    kernels.swigluBackward(dGate, dUp, dAct, a.gate, a.up, R * I);
    kernels.matmulNN(dH, dGate, layer.gate, R, D, I, false, ver);
    kernels.matmulNN(dH, dUp, layer.up, R, D, I, true, ver);
    hooks?.backward?.(l, "gate", dGate, a.h2, dH, R);
    hooks?.backward?.(l, "up", dUp, a.h2, dH, R);
    if (g) kernels.matmulTN(g.gate, dGate, a.h2, I, D, R, true);
    if (g) kernels.matmulTN(g.up, dUp, a.h2, I, D, R, true);
    const dMid = ws.f32(R * D);
    kernels.rmsNormBackward(dMid, g?.postNorm ?? noGrad, dH, a.xMid, a.inv2, layer.postNorm, R, D);
    for (let i = 0; i < R * D; i++) dMid[i] = dMid[i]! + dx[i]!;
    // Attention: x_mid = x_in + o(attention(q, k, v))
    kernels.matmulNN(dAtt, dMid, layer.o, R, qDim, D, false, ver);
    hooks?.backward?.(l, "o", dMid, a.att, dAtt, R);
    if (g) kernels.matmulTN(g.o, dMid, a.att, D, qDim, R, true);
    dq.fill(0);
    dk.fill(0);
    dv.fill(0);
    kernels.attentionBackward(dq, dk, dv, a.q, a.k, a.v, dAtt, T, H, KV, hd, B);
    for (let r = 0; r < R; r++) {
      const pos = r % T;
      for (let h = 0; h < H; h++) applyRope(dq, r * qDim + h * hd, pos, rope, -1);
      for (let h = 0; h < KV; h++) applyRope(dk, r * kvDim + h * hd, pos, rope, -1);
    }
    kernels.matmulNN(dH, dq, layer.q, R, D, qDim, false, ver);
    kernels.matmulNN(dH, dk, layer.k, R, D, kvDim, true, ver);
    kernels.matmulNN(dH, dv, layer.v, R, D, kvDim, true, ver);
    hooks?.backward?.(l, "q", dq, a.h1, dH, R);
    hooks?.backward?.(l, "k", dk, a.h1, dH, R);
    hooks?.backward?.(l, "v", dv, a.h1, dH, R);
    if (g) kernels.matmulTN(g.q, dq, a.h1, qDim, D, R, true);
    if (g) kernels.matmulTN(g.k, dk, a.h1, kvDim, D, R, true);
    if (g) kernels.matmulTN(g.v, dv, a.h1, kvDim, D, R, true);
    const dIn = ws.f32(R * D);
    kernels.rmsNormBackward(dIn, g?.inputNorm ?? noGrad, dH, a.xIn, a.inv1, layer.inputNorm, R, D);
    for (let i = 0; i < R * D; i++) dIn[i] = dIn[i]! + dMid[i]!;
    dx = dIn;
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
