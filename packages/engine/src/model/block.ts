/**
 * One decoder layer, forward and backward: the one place the architecture is written. Inference
 * (`forward.ts`, over KV caches) and training (`train.ts`, over whole sequences) both run their
 * layers through here and differ only in how attention sees its keys (`Attend`) and in which
 * adapters their linears carry (`LinearHooks`).
 */
import type { Kernels, Workspace } from "../kernels/types.ts";
import type { Weight } from "../kernels/weight.ts";
import type { LinearHooks } from "./lora.ts";
import { applyRope, type Model } from "./model.ts";
import type { LayerGrads } from "./weights.ts";

/** What one layer computes over `rows` rows; training keeps one per layer for the backward. */
export interface LayerActivations {
  /** The layer's input (the residual stream). */
  xIn: Float32Array;
  h1: Float32Array;
  inv1: Float32Array;
  /** q and k as attention reads them: normed per head (Qwen3) and rotated. */
  q: Float32Array;
  k: Float32Array;
  v: Float32Array;
  /** With q/k norms: q and k before them, and each head-row's 1/rms (for the backward). */
  qPre: Float32Array | null;
  kPre: Float32Array | null;
  invQ: Float32Array | null;
  invK: Float32Array | null;
  att: Float32Array;
  xMid: Float32Array;
  h2: Float32Array;
  inv2: Float32Array;
  gate: Float32Array;
  up: Float32Array;
  act: Float32Array;
}

/** Attention of one layer: reads the rotated `q`, `k`, `v` rows and writes `att`. */
export type Attend = (layer: number, a: LayerActivations) => void;

/** A pass of several layers over the same rows. */
export interface BlockPass {
  model: Model;
  kernels: Kernels;
  ws: Workspace;
  rows: number;
  /** The RoPE position of each row. */
  positions: Int32Array;
  attend: Attend;
  /** Adapters of the linears (LoRA): their forward, and in training their backward. */
  hooks: LinearHooks | undefined;
  /** Scratch for a projection's output, `rows × hidden`. */
  proj: Float32Array;
}

/** A pass's fixed parts; `proj` is taken from the workspace. */
export function blockPass(
  model: Model,
  kernels: Kernels,
  ws: Workspace,
  positions: Int32Array,
  attend: Attend,
  hooks: LinearHooks | undefined,
): BlockPass {
  const rows = positions.length;
  const proj = ws.f32(rows * model.config.hiddenSize);
  return { model, kernels, ws, rows, positions, attend, hooks, proj };
}

/** Fresh activations for one layer over the pass's rows, `xIn` given. */
export function layerActivations(pass: BlockPass, xIn: Float32Array): LayerActivations {
  const { ws, rows: R } = pass;
  const { hiddenSize: D, numHeads, numKvHeads, headDim, intermediateSize: I } = pass.model.config;
  const qDim = numHeads * headDim;
  const kvDim = numKvHeads * headDim;
  return {
    xIn,
    h1: ws.f32(R * D),
    inv1: ws.f32(R),
    q: ws.f32(R * qDim),
    k: ws.f32(R * kvDim),
    v: ws.f32(R * kvDim),
    ...qkNormBuffers(pass),
    att: ws.f32(R * qDim),
    xMid: ws.f32(R * D),
    h2: ws.f32(R * D),
    inv2: ws.f32(R),
    gate: ws.f32(R * I),
    up: ws.f32(R * I),
    act: ws.f32(R * I),
  };
}

/** Activations for inference, which keeps none for a backward: buffers whose values are no longer
 * needed when the next is written are shared (h2 with h1, act with gate, computed in place). */
export function inferenceActivations(pass: BlockPass, xIn: Float32Array): LayerActivations {
  const { ws, rows: R } = pass;
  const { hiddenSize: D, numHeads, numKvHeads, headDim, intermediateSize: I } = pass.model.config;
  const h1 = ws.f32(R * D);
  const inv1 = ws.f32(R);
  const gate = ws.f32(R * I);
  return {
    xIn,
    h1,
    inv1,
    q: ws.f32(R * numHeads * headDim),
    k: ws.f32(R * numKvHeads * headDim),
    v: ws.f32(R * numKvHeads * headDim),
    ...qkNormBuffers(pass),
    att: ws.f32(R * numHeads * headDim),
    xMid: ws.f32(R * D),
    h2: h1,
    inv2: inv1,
    gate,
    up: ws.f32(R * I),
    act: gate,
  };
}

function qkNormBuffers(pass: BlockPass) {
  const { ws, rows: R } = pass;
  const { numHeads, numKvHeads, headDim, qkNorm } = pass.model.config;
  if (!qkNorm) return { qPre: null, kPre: null, invQ: null, invK: null };
  return {
    qPre: ws.f32(R * numHeads * headDim),
    kPre: ws.f32(R * numKvHeads * headDim),
    invQ: ws.f32(R * numHeads),
    invK: ws.f32(R * numKvHeads),
  };
}

/**
 * Layer `l` over `a.xIn` into `xOut` (which may be `a.xIn` itself when the input is not needed
 * again): x_mid = x + o(attention(rope(q(norm x)), rope(k(norm x)), v(norm x))), then
 * x_out = x_mid + down(silu(gate(norm x_mid)) · up(norm x_mid)).
 */
export function layerForward(
  pass: BlockPass,
  l: number,
  a: LayerActivations,
  xOut: Float32Array,
): void {
  const { model, kernels, rows: R, hooks, proj } = pass;
  const { config, weights, version: ver } = model;
  const layer = weights.layers[l]!;
  const D = config.hiddenSize;
  const I = config.intermediateSize;
  const qDim = config.numHeads * config.headDim;
  const kvDim = config.numKvHeads * config.headDim;
  const eps = config.rmsNormEps;
  const x = a.xIn;

  const { numHeads: H, numKvHeads: KV, headDim: hd } = config;
  kernels.rmsNorm(a.h1, x, layer.inputNorm, R, D, eps, a.inv1);
  // With q/k norms, the projections land before them (kept for the backward).
  const q = a.qPre ?? a.q;
  const k = a.kPre ?? a.k;
  linears(kernels, [q, k, a.v], a.h1, [layer.q, layer.k, layer.v], R, [qDim, kvDim, kvDim], D, ver);
  if (layer.qBias) addRows(q, layer.qBias, R);
  if (layer.kBias) addRows(k, layer.kBias, R);
  if (layer.vBias) addRows(a.v, layer.vBias, R);
  hooks?.forward(l, "q", q, a.h1, R);
  hooks?.forward(l, "k", k, a.h1, R);
  hooks?.forward(l, "v", a.v, a.h1, R);
  if (layer.qNorm && layer.kNorm) {
    kernels.rmsNorm(a.q, q, layer.qNorm, R * H, hd, eps, a.invQ ?? undefined);
    kernels.rmsNorm(a.k, k, layer.kNorm, R * KV, hd, eps, a.invK ?? undefined);
  }
  if (rotates(model, l)) {
    rope(model, a.q, H, pass.positions, 1);
    rope(model, a.k, KV, pass.positions, 1);
  }
  pass.attend(l, a);
  kernels.matmulNT(proj, a.att, layer.o, R, D, qDim, false, ver);
  if (layer.oBias) addRows(proj, layer.oBias, R);
  hooks?.forward(l, "o", proj, a.att, R);
  for (let i = 0; i < R * D; i++) a.xMid[i] = x[i]! + proj[i]!;

  kernels.rmsNorm(a.h2, a.xMid, layer.postNorm, R, D, eps, a.inv2);
  linears(kernels, [a.gate, a.up], a.h2, [layer.gate, layer.up], R, [I, I], D, ver);
  hooks?.forward(l, "gate", a.gate, a.h2, R);
  hooks?.forward(l, "up", a.up, a.h2, R);
  kernels.swiglu(a.act, a.gate, a.up, R * I);
  kernels.matmulNT(proj, a.act, layer.down, R, D, I, false, ver);
  hooks?.forward(l, "down", proj, a.act, R);
  for (let i = 0; i < R * D; i++) xOut[i] = a.xMid[i]! + proj[i]!;
}

/** Linears of one input: in one kernel call where the kernels share work between them. */
function linears(
  kernels: Kernels,
  outs: Float32Array[],
  x: Float32Array,
  weights: Weight[],
  R: number,
  Ns: number[],
  K: number,
  ver: number,
): void {
  if (kernels.matmulNTShared) {
    kernels.matmulNTShared(outs, x, weights, R, Ns, K, ver);
    return;
  }
  for (let i = 0; i < outs.length; i++)
    kernels.matmulNT(outs[i]!, x, weights[i]!, R, Ns[i]!, K, false, ver);
}

/** Gradients a layer's backward writes: the weights' (full fine-tuning) and attention's. */
export interface LayerGradients {
  layer: LayerGrads | undefined;
  /** Attention's backward, given d(att): adds into dq, dk, dv. */
  attendBackward(
    a: LayerActivations,
    dAtt: Float32Array,
    dq: Float32Array,
    dk: Float32Array,
    dv: Float32Array,
  ): void;
}

/** Scratch for the backward of every layer of a pass. */
export interface BackwardScratch {
  /** d(loss)/d(q, k) before the q/k norms (Qwen3). */
  dqPre: Float32Array | null;
  dkPre: Float32Array | null;
  /** A head-sized weight gradient that is thrown away. */
  noGradHead: Float32Array;
  dH: Float32Array;
  dAct: Float32Array;
  dGate: Float32Array;
  dUp: Float32Array;
  dAtt: Float32Array;
  dq: Float32Array;
  dk: Float32Array;
  dv: Float32Array;
  dMid: Float32Array;
  /** A weight gradient that is thrown away (no full fine-tuning). */
  noGrad: Float32Array;
}

export function backwardScratch(pass: BlockPass): BackwardScratch {
  const { ws, rows: R } = pass;
  const { hiddenSize: D, numHeads, numKvHeads, headDim, intermediateSize: I } = pass.model.config;
  const qkNorm = pass.model.config.qkNorm;
  return {
    dqPre: qkNorm ? ws.f32(R * numHeads * headDim) : null,
    dkPre: qkNorm ? ws.f32(R * numKvHeads * headDim) : null,
    noGradHead: ws.f32(headDim),
    dH: ws.f32(R * D),
    dAct: ws.f32(R * I),
    dGate: ws.f32(R * I),
    dUp: ws.f32(R * I),
    dAtt: ws.f32(R * numHeads * headDim),
    dq: ws.f32(R * numHeads * headDim),
    dk: ws.f32(R * numKvHeads * headDim),
    dv: ws.f32(R * numKvHeads * headDim),
    dMid: ws.f32(R * D),
    noGrad: ws.f32(D),
  };
}

/**
 * The backward of `layerForward`: given `dx` = d(loss)/d(x_out), writes d(loss)/d(x_in) into
 * `dIn`, adds the weights' gradients into `grads.layer` (when training all weights) and lets
 * the hooks add theirs (LoRA).
 */
export function layerBackward(
  pass: BlockPass,
  l: number,
  a: LayerActivations,
  dx: Float32Array,
  dIn: Float32Array,
  grads: LayerGradients,
  s: BackwardScratch,
): void {
  const { model, kernels, rows: R, hooks } = pass;
  const { config, weights, version: ver } = model;
  const layer = weights.layers[l]!;
  const g = grads.layer;
  const D = config.hiddenSize;
  const I = config.intermediateSize;
  const qDim = config.numHeads * config.headDim;
  const kvDim = config.numKvHeads * config.headDim;

  // MLP: x_out = x_mid + down(silu(gate) * up)
  kernels.matmulNN(s.dAct, dx, layer.down, R, I, D, false, ver);
  hooks?.backward?.(l, "down", dx, a.act, s.dAct, R);
  if (g) kernels.matmulTN(g.down, dx, a.act, D, I, R, true);
  kernels.swigluBackward(s.dGate, s.dUp, s.dAct, a.gate, a.up, R * I);
  kernels.matmulNN(s.dH, s.dGate, layer.gate, R, D, I, false, ver);
  kernels.matmulNN(s.dH, s.dUp, layer.up, R, D, I, true, ver);
  hooks?.backward?.(l, "gate", s.dGate, a.h2, s.dH, R);
  hooks?.backward?.(l, "up", s.dUp, a.h2, s.dH, R);
  if (g) kernels.matmulTN(g.gate, s.dGate, a.h2, I, D, R, true);
  if (g) kernels.matmulTN(g.up, s.dUp, a.h2, I, D, R, true);
  const dMid = s.dMid;
  kernels.rmsNormBackward(
    dMid,
    g?.postNorm ?? s.noGrad,
    s.dH,
    a.xMid,
    a.inv2,
    layer.postNorm,
    R,
    D,
  );
  for (let i = 0; i < R * D; i++) dMid[i] = dMid[i]! + dx[i]!;

  // Attention: x_mid = x_in + o(attention(q, k, v))
  const { numHeads: H, numKvHeads: KV, headDim: hd } = config;
  kernels.matmulNN(s.dAtt, dMid, layer.o, R, qDim, D, false, ver);
  hooks?.backward?.(l, "o", dMid, a.att, s.dAtt, R);
  if (g) kernels.matmulTN(g.o, dMid, a.att, D, qDim, R, true);
  if (g?.oBias) sumRows(g.oBias, dMid, R);
  s.dq.fill(0);
  s.dk.fill(0);
  s.dv.fill(0);
  grads.attendBackward(a, s.dAtt, s.dq, s.dk, s.dv);
  if (rotates(model, l)) {
    rope(model, s.dq, H, pass.positions, -1);
    rope(model, s.dk, KV, pass.positions, -1);
  }
  // Through the q/k norms: the gradients below are the projections' (before the norms).
  let dq = s.dq;
  let dk = s.dk;
  if (layer.qNorm && layer.kNorm && a.qPre && a.kPre && a.invQ && a.invK && s.dqPre && s.dkPre) {
    kernels.rmsNormBackward(
      s.dqPre,
      g?.qNorm ?? s.noGradHead,
      dq,
      a.qPre,
      a.invQ,
      layer.qNorm,
      R * H,
      hd,
    );
    kernels.rmsNormBackward(
      s.dkPre,
      g?.kNorm ?? s.noGradHead,
      dk,
      a.kPre,
      a.invK,
      layer.kNorm,
      R * KV,
      hd,
    );
    dq = s.dqPre;
    dk = s.dkPre;
  }
  kernels.matmulNN(s.dH, dq, layer.q, R, D, qDim, false, ver);
  kernels.matmulNN(s.dH, dk, layer.k, R, D, kvDim, true, ver);
  kernels.matmulNN(s.dH, s.dv, layer.v, R, D, kvDim, true, ver);
  hooks?.backward?.(l, "q", dq, a.h1, s.dH, R);
  hooks?.backward?.(l, "k", dk, a.h1, s.dH, R);
  hooks?.backward?.(l, "v", s.dv, a.h1, s.dH, R);
  if (g) kernels.matmulTN(g.q, dq, a.h1, qDim, D, R, true);
  if (g) kernels.matmulTN(g.k, dk, a.h1, kvDim, D, R, true);
  if (g) kernels.matmulTN(g.v, s.dv, a.h1, kvDim, D, R, true);
  if (g?.qBias) sumRows(g.qBias, dq, R);
  if (g?.kBias) sumRows(g.kBias, dk, R);
  if (g?.vBias) sumRows(g.vBias, s.dv, R);
  kernels.rmsNormBackward(
    dIn,
    g?.inputNorm ?? s.noGrad,
    s.dH,
    a.xIn,
    a.inv1,
    layer.inputNorm,
    R,
    D,
  );
  for (let i = 0; i < R * D; i++) dIn[i] = dIn[i]! + dMid[i]!;
}

/** Whether layer `l` rotates q and k (SmolLM3's NoPE layers do not). */
function rotates(model: Model, l: number): boolean {
  return model.config.ropeLayers?.[l] ?? true;
}

/** x[r] += bias, for each of `rows` rows. */
function addRows(x: Float32Array, bias: Float32Array, rows: number): void {
  const n = bias.length;
  for (let r = 0; r < rows; r++) {
    const o = r * n;
    for (let j = 0; j < n; j++) x[o + j] = x[o + j]! + bias[j]!;
  }
}

/** out += Σ_r x[r] (a bias's gradient). */
function sumRows(out: Float32Array, x: Float32Array, rows: number): void {
  const n = out.length;
  for (let r = 0; r < rows; r++) {
    const o = r * n;
    for (let j = 0; j < n; j++) out[j] = out[j]! + x[o + j]!;
  }
}

/** Rotates every head of every row by its row's position (`sign` -1 undoes it: backward). */
function rope(
  model: Model,
  x: Float32Array,
  heads: number,
  positions: Int32Array,
  sign: 1 | -1,
): void {
  const hd = model.config.headDim;
  const width = heads * hd;
  for (let r = 0; r < positions.length; r++) {
    const pos = positions[r]!;
    for (let h = 0; h < heads; h++) applyRope(x, r * width + h * hd, pos, model.rope, sign);
  }
}
