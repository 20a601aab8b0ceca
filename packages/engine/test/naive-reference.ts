import type { Model } from "../src/model/model.ts";

/** A deliberately naive, per-element, float64 Llama forward over a whole sequence (no cache). */
export function naiveLogits(model: Model<Float32Array>, tokens: number[]): number[][] {
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
