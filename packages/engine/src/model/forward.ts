import { type Kernels, withWorkspace } from "../kernels/types.ts";
import { copyRow } from "../kernels/weight.ts";
import { type Attend, blockPass, inferenceActivations, layerForward } from "./block.ts";
import { type LinearHooks, type LoraAdapter, loraRowHooks } from "./lora.ts";
import type { Model } from "./model.ts";

/** Keys and values of one sequence, per layer, [positions, kvHeads·headDim]. The arrays grow
 * (doubling) as the sequence does, up to `limit` positions: a long context costs memory only
 * when it is used. */
export interface KvCache {
  keys: Float32Array[];
  values: Float32Array[];
  length: number;
  /** The most positions the cache may hold. */
  limit: number;
  /** Kernels whose memory holds the arrays (attention reads them in place), or none. */
  kernels?: Kernels;
}

/** Positions allocated at first; a cache grows from there. */
const INITIAL_POSITIONS = 256;

/**
 * An empty cache of up to `limit` positions; with `kernels` that have memory of their own, its
 * arrays live there (one copy, read in place: free it with `releaseKvCache`).
 */
export function createKvCache(
  model: Model,
  limit = model.config.maxPositions,
  kernels?: Kernels,
): KvCache {
  const kvDim = model.config.numKvHeads * model.config.headDim;
  const capped = Math.min(limit, model.config.maxPositions);
  const size = Math.min(capped, INITIAL_POSITIONS) * kvDim;
  const inArena = kernels?.array ? kernels : undefined;
  const make = () => (inArena ? inArena.array!(size) : new Float32Array(size));
  return {
    keys: model.weights.layers.map(make),
    values: model.weights.layers.map(make),
    length: 0,
    limit: capped,
    ...(inArena ? { kernels: inArena } : {}),
  };
}

/** Frees the arrays of a cache kept in kernels' memory now (else when they are collected). */
export function releaseKvCache(cache: KvCache): void {
  const kernels = cache.kernels;
  if (!kernels?.freeArray) return;
  for (const a of [...cache.keys, ...cache.values]) kernels.freeArray(a);
  cache.keys = [];
  cache.values = [];
  delete cache.kernels;
}

/** Makes room for `positions` in the cache (copying what it holds into larger arrays). */
function reserve(cache: KvCache, positions: number, kvDim: number): void {
  const allocated = cache.keys[0]!.length / kvDim;
  if (positions <= allocated) return;
  const size = Math.min(cache.limit, Math.max(positions, allocated * 2)) * kvDim;
  const kernels = cache.kernels;
  // Every larger array first: when the memory runs out, the cache is left as it was.
  const next: Float32Array[] = [];
  try {
    for (let i = 0; i < cache.keys.length * 2; i++)
      next.push(kernels ? kernels.array!(size) : new Float32Array(size));
  } catch (err) {
    if (kernels) for (const a of next) kernels.freeArray!(a);
    throw err;
  }
  const move = (old: Float32Array, i: number) => {
    next[i]!.set(old.subarray(0, cache.length * kvDim));
    if (kernels) kernels.freeArray!(old);
    return next[i]!;
  };
  const L = cache.keys.length;
  cache.keys = cache.keys.map((old, l) => move(old, l));
  cache.values = cache.values.map((old, l) => move(old, L + l));
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
  const { config, weights } = model;
  const D = config.hiddenSize;
  const kvDim = config.numKvHeads * config.headDim;
  const rows = items.reduce((n, item) => n + item.tokens.length, 0);
  const positions = new Int32Array(rows);
  let r = 0;
  for (const item of items) {
    if (item.cache.length + item.tokens.length > item.cache.limit) {
      throw new Error("forward: sequence exceeds the context length");
    }
    reserve(item.cache, item.cache.length + item.tokens.length, kvDim);
    for (let t = 0; t < item.tokens.length; t++) positions[r++] = item.cache.length + t;
  }
  return withWorkspace(kernels, (ws) => {
    const x = ws.f32(rows * D);
    r = 0;
    for (const item of items) {
      for (const token of item.tokens) {
        if (token < 0 || token >= config.vocabSize)
          throw new Error(`forward: token ${token} out of range`);
        copyRow(weights.embed, D, token, x, r * D);
        r++;
      }
    }
    const hooks: LinearHooks | undefined = items.some((item) => item.adapter)
      ? loraRowHooks(kernels, items)
      : undefined;
    const pass = blockPass(
      model,
      kernels,
      ws,
      positions,
      attendCached(model, kernels, items),
      hooks,
    );
    // One set of activations serves every layer: inference keeps none for a backward.
    const a = inferenceActivations(pass, x);
    for (let l = 0; l < config.numLayers; l++) layerForward(pass, l, a, x);
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
      model.version,
    );
    // An adapted head: one row per item, each under its own adapter.
    if (hooks) {
      const heads = items.map((item) => ({ tokens: [0], adapter: item.adapter ?? null }));
      loraRowHooks(kernels, heads).forward(-1, "head", logits, normed, items.length);
    }
    return items.map((_, i) => logits.subarray(i * config.vocabSize, (i + 1) * config.vocabSize));
  });
}

/** Attention against each item's cache: its new keys and values are appended first. */
function attendCached(model: Model, kernels: Kernels, items: readonly ForwardItem[]): Attend {
  const { numHeads: H, numKvHeads: KV, headDim: hd } = model.config;
  const qDim = H * hd;
  const kvDim = KV * hd;
  return (l, a) => {
    let r = 0;
    for (const item of items) {
      const { cache } = item;
      const keys = cache.keys[l]!;
      const values = cache.values[l]!;
      const n = item.tokens.length;
      keys.set(a.k.subarray(r * kvDim, (r + n) * kvDim), cache.length * kvDim);
      values.set(a.v.subarray(r * kvDim, (r + n) * kvDim), cache.length * kvDim);
      kernels.attention(
        a.att.subarray(r * qDim, (r + n) * qDim),
        a.q.subarray(r * qDim, (r + n) * qDim),
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
  };
}
