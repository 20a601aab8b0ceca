import { describe, expect, it } from "vitest";
import { createKvCache, forwardBatch } from "./forward.ts";
import { jsKernels } from "./kernels.ts";
import type { Model } from "./model.ts";
import { tinyModel } from "./test-fixtures.ts";

/** A deliberately naive, per-element, float64 Llama forward over a whole sequence (no cache). */
function naiveLogits(model: Model, tokens: number[]): number[][] {
  const c = model.config;
  const w = model.weights;
  const D = c.hiddenSize;
  const hd = c.headDim;
  const T = tokens.length;
  const linear = (x: number[], W: Float32Array, outDim: number) => {
    const inDim = x.length;
    const y: number[] = [];
    for (let o = 0; o < outDim; o++) {
      let s = 0;
      for (let i = 0; i < inDim; i++) s += x[i]! * W[o * inDim + i]!;
      y.push(s);
    }
    return y;
  };
  const norm = (x: number[], g: Float32Array) => {
    const ms = x.reduce((s, v) => s + v * v, 0) / x.length;
    return x.map((v, i) => (v / Math.sqrt(ms + c.rmsNormEps)) * g[i]!);
  };
  const rope = (vec: number[], pos: number) => {
    const half = hd / 2;
    const out = vec.slice();
    for (let i = 0; i < half; i++) {
      const angle = pos / c.ropeTheta ** ((2 * i) / hd);
      out[i] = vec[i]! * Math.cos(angle) - vec[i + half]! * Math.sin(angle);
      out[i + half] = vec[i + half]! * Math.cos(angle) + vec[i]! * Math.sin(angle);
    }
    return out;
  };
  let xs = tokens.map((t) => Array.from(w.embed.subarray(t * D, t * D + D)));
  for (const layer of w.layers) {
    const hs = xs.map((x) => norm(x, layer.inputNorm));
    const qs = hs.map((h) => linear(h, layer.q, c.numHeads * hd));
    const ks = hs.map((h) => linear(h, layer.k, c.numKvHeads * hd));
    const vs = hs.map((h) => linear(h, layer.v, c.numKvHeads * hd));
    const attn = xs.map(() => [] as number[]);
    for (let head = 0; head < c.numHeads; head++) {
      const kvHead = Math.floor(head / (c.numHeads / c.numKvHeads));
      for (let t = 0; t < T; t++) {
        const q = rope(qs[t]!.slice(head * hd, head * hd + hd), t);
        const scores: number[] = [];
        for (let j = 0; j <= t; j++) {
          const k = rope(ks[j]!.slice(kvHead * hd, kvHead * hd + hd), j);
          scores.push(q.reduce((s, v, i) => s + v * k[i]!, 0) / Math.sqrt(hd));
        }
        const max = Math.max(...scores);
        const exps = scores.map((s) => Math.exp(s - max));
        const total = exps.reduce((a, b) => a + b, 0);
        for (let i = 0; i < hd; i++) {
          let s = 0;
          for (let j = 0; j <= t; j++) s += (exps[j]! / total) * vs[j]![kvHead * hd + i]!;
          attn[t]!.push(s);
        }
      }
    }
    xs = xs.map((x, t) => {
      const o = linear(attn[t]!, layer.o, D);
      return x.map((v, i) => v + o[i]!);
    });
    xs = xs.map((x) => {
      const h = norm(x, layer.postNorm);
      const g = linear(h, layer.gate, c.intermediateSize);
      const u = linear(h, layer.up, c.intermediateSize);
      const a = g.map((gv, i) => (gv / (1 + Math.exp(-gv))) * u[i]!);
      const d = linear(a, layer.down, D);
      return x.map((v, i) => v + d[i]!);
    });
  }
  return xs.map((x) => linear(norm(x, w.norm), w.lmHead ?? w.embed, c.vocabSize));
}

describe("forwardBatch", () => {
  const tokens = [5, 17, 42, 99, 3, 250, 7, 64];

  for (const tied of [false, true]) {
    it(`when run token by token with a cache (tied=${tied}), then logits match a naive forward`, () => {
      const model = tinyModel(3, { tieWordEmbeddings: tied });
      if (tied) model.weights.lmHead = null;
      const reference = naiveLogits(model, tokens);
      const cache = createKvCache(model);
      tokens.forEach((token, t) => {
        const [logits] = forwardBatch(model, jsKernels, [{ cache, tokens: [token] }]);
        const want = reference[t]!;
        for (let i = 0; i < want.length; i++) expect(logits![i]).toBeCloseTo(want[i]!, 3);
      });
    });
  }

  it("when a prompt is prefilled at once, then the last logits equal the incremental ones", () => {
    const model = tinyModel(4);
    const reference = naiveLogits(model, tokens);
    const [logits] = forwardBatch(model, jsKernels, [{ cache: createKvCache(model), tokens }]);
    const want = reference[tokens.length - 1]!;
    const spread = Math.max(...want) - Math.min(...want);
    expect(spread).toBeGreaterThan(1);
    for (let i = 0; i < want.length; i++) expect(logits![i]).toBeCloseTo(want[i]!, 3);
  });

  it("when sequences are batched, then each gets exactly its single-sequence logits", () => {
    const model = tinyModel(5);
    const a = [1, 2, 3, 4, 5];
    const b = [9, 8, 7];
    const [alone] = forwardBatch(model, jsKernels, [{ cache: createKvCache(model), tokens: a }]);
    const [, together] = forwardBatch(model, jsKernels, [
      { cache: createKvCache(model), tokens: b },
      { cache: createKvCache(model), tokens: a },
    ]);
    expect(Array.from(together!)).toEqual(Array.from(alone!));
  });
});
