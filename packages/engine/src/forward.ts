import { type Kernels, type Workspace, withWorkspace } from "./kernels.ts";
import { addLoraRows, type LoraAdapter } from "./lora.ts";
import { applyRope, type Model } from "./model.ts";

/** Keys and values of one sequence, per layer, [maxPositions, kvHeads·headDim]. */
export interface KvCache {
  keys: Float32Array[];
  values: Float32Array[];
  length: number;
}

export function createKvCache(model: Model, capacity = model.config.maxPositions): KvCache {
  const kvDim = model.config.numKvHeads * model.config.headDim;
  const size = Math.min(capacity, model.config.maxPositions) * kvDim;
  return {
    keys: model.weights.layers.map(() => new Float32Array(size)),
    values: model.weights.layers.map(() => new Float32Array(size)),
    length: 0,
  };
}

export interface ForwardItem {
  cache: KvCache;
  /** New tokens appended after the cache's current length. */
  tokens: readonly number[];
  /** A LoRA adapter applied to this item's rows only (the base GEMMs stay shared). */
  adapter?: LoraAdapter | null;
}

/**
 * One forward pass over several sequences at once: the new tokens of all items are stacked
 * as rows of one matrix, so every Linear is one GEMM (continuous batching); attention runs
 * per sequence against its own cache. Returns the logits of each item's last new token.
 */
export function forwardBatch(
  model: Model,
  kernels: Kernels,
  items: readonly ForwardItem[],
): Float32Array[] {
  return withWorkspace(kernels, (ws) => forwardBatchIn(ws, model, kernels, items));
}

function forwardBatchIn(
  ws: Workspace,
  model: Model,
  kernels: Kernels,
  items: readonly ForwardItem[],
): Float32Array[] {
  const { config, weights, rope } = model;
  const D = config.hiddenSize;
  const hd = config.headDim;
  const H = config.numHeads;
  const KV = config.numKvHeads;
  const qDim = H * hd;
  const kvDim = KV * hd;
  const I = config.intermediateSize;
  const rows = items.reduce((n, item) => n + item.tokens.length, 0);
  for (const item of items) {
    if (item.cache.length + item.tokens.length > item.cache.keys[0]!.length / kvDim) {
      throw new Error("forward: sequence exceeds the context length");
    }
  }
  const x = ws.f32(rows * D);
  let r = 0;
  for (const item of items) {
    for (const token of item.tokens) {
      if (token < 0 || token >= config.vocabSize)
        throw new Error(`forward: token ${token} out of range`);
      x.set(weights.embed.subarray(token * D, token * D + D), r * D);
      r++;
    }
  }
  const h = ws.f32(rows * D);
  const q = ws.f32(rows * qDim);
  const k = ws.f32(rows * kvDim);
  const v = ws.f32(rows * kvDim);
  const att = ws.f32(rows * qDim);
  const proj = ws.f32(rows * D);
  const gate = ws.f32(rows * I);
  const up = ws.f32(rows * I);
  const ver = model.version;
  const lora = items.some((item) => item.adapter);

  for (let l = 0; l < config.numLayers; l++) {
    const layer = weights.layers[l]!;
    kernels.rmsNorm(h, x, layer.inputNorm, rows, D, config.rmsNormEps);
    kernels.matmulNT(q, h, layer.q, rows, qDim, D, false, ver);
    kernels.matmulNT(k, h, layer.k, rows, kvDim, D, false, ver);
    kernels.matmulNT(v, h, layer.v, rows, kvDim, D, false, ver);
    if (lora) {
      addLoraRows(kernels, items, l, "q", q, h, qDim, D);
      addLoraRows(kernels, items, l, "k", k, h, kvDim, D);
      addLoraRows(kernels, items, l, "v", v, h, kvDim, D);
    }
    r = 0;
    for (const item of items) {
      const cache = item.cache;
      const keys = cache.keys[l]!;
      const values = cache.values[l]!;
      const n = item.tokens.length;
      for (let t = 0; t < n; t++) {
        const pos = cache.length + t;
        const row = r + t;
        for (let hh = 0; hh < H; hh++) applyRope(q, row * qDim + hh * hd, pos, rope);
        for (let hh = 0; hh < KV; hh++) applyRope(k, row * kvDim + hh * hd, pos, rope);
      }
      keys.set(k.subarray(r * kvDim, (r + n) * kvDim), cache.length * kvDim);
      values.set(v.subarray(r * kvDim, (r + n) * kvDim), cache.length * kvDim);
      kernels.attention(
        att.subarray(r * qDim, (r + n) * qDim),
        q.subarray(r * qDim, (r + n) * qDim),
        keys,
        values,
        n,
        cache.length,
        H,
        KV,
        hd,
      );
      r += n;
    }
    kernels.matmulNT(proj, att, layer.o, rows, D, qDim, false, ver);
    if (lora) addLoraRows(kernels, items, l, "o", proj, att, D, qDim);
    for (let i = 0; i < rows * D; i++) x[i] = x[i]! + proj[i]!;
    kernels.rmsNorm(h, x, layer.postNorm, rows, D, config.rmsNormEps);
    kernels.matmulNT(gate, h, layer.gate, rows, I, D, false, ver);
    kernels.matmulNT(up, h, layer.up, rows, I, D, false, ver);
    if (lora) {
      addLoraRows(kernels, items, l, "gate", gate, h, I, D);
      addLoraRows(kernels, items, l, "up", up, h, I, D);
    }
    kernels.swiglu(gate, gate, up, rows * I);
    kernels.matmulNT(proj, gate, layer.down, rows, D, I, false, ver);
    if (lora) addLoraRows(kernels, items, l, "down", proj, gate, D, I);
    for (let i = 0; i < rows * D; i++) x[i] = x[i]! + proj[i]!;
  }
  for (const item of items) item.cache.length += item.tokens.length;

  // Only each item's last row needs logits.
  const last = ws.f32(items.length * D);
  r = 0;
  items.forEach((item, i) => {
    r += item.tokens.length;
    last.set(x.subarray((r - 1) * D, r * D), i * D);
  });
  const normed = ws.f32(items.length * D);
  kernels.rmsNorm(normed, last, weights.norm, items.length, D, config.rmsNormEps);
  const logits = new Float32Array(items.length * config.vocabSize); // returned
  kernels.matmulNT(
    logits,
    normed,
    weights.lmHead ?? weights.embed,
    items.length,
    config.vocabSize,
    D,
    false,
    ver,
  );
  return items.map((_, i) => logits.subarray(i * config.vocabSize, (i + 1) * config.vocabSize));
}
