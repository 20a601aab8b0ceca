import { describe, expect, it } from "vitest";
import { randomBatch, tinyModel } from "../../test/fixtures.ts";
import { jsKernels } from "../kernels/js.ts";
import { createWasmKernels } from "../kernels/wasm.ts";
import { createKvCache, forwardBatch } from "../model/forward.ts";
import { Rng } from "../model/rng.ts";
import { parameters, zerosLike } from "../model/weights.ts";
import { learningRate, Trainer } from "./optim.ts";
import { lossAndGradients, type TrainBatch } from "./train.ts";

describe("lossAndGradients", () => {
  for (const tied of [false, true]) {
    it(`when compared with central finite differences (tied=${tied}), then every tensor's gradient agrees`, () => {
      const model = tinyModel(7, { tieWordEmbeddings: tied });
      if (tied) model.weights.lmHead = null;
      // Small weights keep the loss smooth enough for float32 finite differences.
      for (const p of parameters(model.config, model.weights)) {
        if (p.shape.length === 2)
          for (let i = 0; i < p.data.length; i++) p.data[i] = p.data[i]! * 0.5;
      }
      const batch = randomBatch(model.config.vocabSize, 2, 6, 11);
      const grads = zerosLike(model.weights);
      lossAndGradients(model, jsKernels, batch, grads);
      const gradParams = parameters(model.config, grads);
      const rng = new Rng(3);
      parameters(model.config, model.weights).forEach((p, index) => {
        const g = gradParams[index]!.data;
        // Check the largest-gradient entries plus a few random ones.
        const order = [...g.keys()].sort((a, b) => Math.abs(g[b]!) - Math.abs(g[a]!));
        const picks = [...order.slice(0, 3), rng.int(g.length), rng.int(g.length)];
        for (const i of picks) {
          const original = p.data[i]!;
          const h = 1e-2;
          p.data[i] = original + h;
          const up = lossAndGradients(model, jsKernels, batch, null).loss;
          p.data[i] = original - h;
          const down = lossAndGradients(model, jsKernels, batch, null).loss;
          p.data[i] = original;
          const numeric = (up - down) / (2 * h);
          expect(Math.abs(numeric - g[i]!), `${p.name}[${i}]`).toBeLessThan(
            2e-4 + 0.02 * Math.abs(numeric),
          );
        }
      });
    });
  }

  it("when the loss is computed, then it matches cross-entropy of the inference logits", () => {
    const model = tinyModel(8);
    const tokens = [3, 14, 15, 92, 65];
    const targets = [14, 15, 92, 65, 35];
    const batch: TrainBatch = {
      batchSize: 1,
      seqLen: 5,
      inputs: Int32Array.from(tokens),
      targets: Int32Array.from(targets),
      lossMask: Float32Array.from([0, 1, 1, 0, 1]),
    };
    const { loss, tokenLogprobs } = lossAndGradients(model, jsKernels, batch, null);
    const cache = createKvCache(model);
    let expected = 0;
    tokens.forEach((token, t) => {
      const [logits] = forwardBatch(model, jsKernels, [{ cache, tokens: [token] }]);
      const max = Math.max(...logits!);
      const lse = max + Math.log(logits!.reduce((s, v) => s + Math.exp(v - max), 0));
      const logp = logits![targets[t]!]! - lse;
      expect(tokenLogprobs[t]).toBeCloseTo(logp, 4);
      expect(batch.lossMask[t]).toBeDefined();
      if (batch.lossMask[t] === 1) expected -= logp;
    });
    expect(loss).toBeCloseTo(expected / 3, 4);
  });
});

describe("lossAndGradients on WASM kernels", () => {
  it("when run on the WASM kernels, then loss and gradients match the JS kernels", () => {
    const config = {
      hiddenSize: 64,
      intermediateSize: 96,
      headDim: 32,
      numHeads: 2,
      numKvHeads: 1,
    };
    const model = tinyModel(13, config);
    const batch = randomBatch(model.config.vocabSize, 2, 9, 17);
    const jsGrads = zerosLike(model.weights);
    const wasmGrads = zerosLike(model.weights);
    const a = lossAndGradients(model, jsKernels, batch, jsGrads);
    const b = lossAndGradients(model, createWasmKernels(), batch, wasmGrads);
    expect(b.loss).toBeCloseTo(a.loss, 4);
    const want = parameters(model.config, jsGrads);
    parameters(model.config, wasmGrads).forEach((p, i) => {
      const w = want[i]!.data;
      let worst = 0;
      let scale = 0;
      for (let j = 0; j < w.length; j++) {
        worst = Math.max(worst, Math.abs(p.data[j]! - w[j]!));
        scale = Math.max(scale, Math.abs(w[j]!));
      }
      expect(worst, p.name).toBeLessThan(1e-3 * scale + 1e-6);
    });
  });
});

describe("lossAndGradients, the head at masked rows only", () => {
  it("when only rows of non-zero mask get the head, then the loss, entropy, objective log-probs and every gradient are the same bits", () => {
    const model = tinyModel(21, { intermediateSize: 44 });
    const batch = randomBatch(model.config.vocabSize, 3, 11, 5);
    const masked = Array.from(batch.lossMask).filter((m) => m !== 0).length;
    // Some rows are left out, and some kept (else every row would be computed anyway).
    expect(masked).toBeGreaterThan(0);
    expect(masked).toBeLessThan(batch.lossMask.length);
    const kernels = createWasmKernels();
    const run = (maskedRowsOnly: boolean) => {
      const grads = zerosLike(model.weights);
      const seen: Float32Array[] = [];
      const result = lossAndGradients(model, kernels, batch, grads, {
        entropy: true,
        maskedRowsOnly,
        objective: (logprobs) => {
          seen.push(logprobs.map((lp, r) => (batch.lossMask[r] === 0 ? 0 : lp)));
          const grad = batch.lossMask.map((m, r) => -m * (1 + (r % 3)) * 0.1);
          let loss = 0;
          for (let r = 0; r < grad.length; r++) loss += grad[r]! * logprobs[r]!;
          return { loss, grad };
        },
      });
      return { result, seen, grads: parameters(model.config, grads).map((p) => p.data) };
    };
    const all = run(false);
    const some = run(true);
    expect(some.result.loss).toBe(all.result.loss);
    expect(some.result.entropy).toEqual(all.result.entropy);
    expect(some.seen).toEqual(all.seen);
    expect(some.grads).toEqual(all.grads);
    // The embeddings' and the head's gradients are not all zero (the test is not vacuous).
    expect(some.grads[0]!.some((g) => g !== 0)).toBe(true);
  });
});

describe("Trainer", () => {
  it("when trained on one batch, then the loss falls and a same-seed rerun is bit-identical", () => {
    const run = () => {
      const model = tinyModel(9);
      const trainer = new Trainer(model, jsKernels, {
        schedule: { kind: "cosine", peak: 1e-2, warmupSteps: 2, totalSteps: 20 },
      });
      const batch = randomBatch(model.config.vocabSize, 2, 8, 5);
      const losses = [];
      for (let i = 0; i < 20; i++) losses.push(trainer.step(batch).loss);
      return { losses, weights: Array.from(model.weights.layers[0]!.q.subarray(0, 16)) };
    };
    const a = run();
    const b = run();
    expect(a.losses.at(-1)!).toBeLessThan(a.losses[0]! * 0.5);
    expect(b).toEqual(a);
  });
});

describe("learningRate", () => {
  const base = { peak: 1, warmupSteps: 10, totalSteps: 110, minRatio: 0.1 };
  it("when warming up, then it rises linearly to the peak", () => {
    expect(learningRate({ ...base, kind: "cosine" }, 0)).toBeCloseTo(0.1);
    expect(learningRate({ ...base, kind: "cosine" }, 9)).toBeCloseTo(1);
  });
  it("when decaying, then cosine and linear reach the floor and constant stays", () => {
    expect(learningRate({ ...base, kind: "cosine" }, 60)).toBeCloseTo(0.55);
    expect(learningRate({ ...base, kind: "linear" }, 60)).toBeCloseTo(0.55);
    expect(learningRate({ ...base, kind: "cosine" }, 110)).toBeCloseTo(0.1);
    expect(learningRate({ ...base, kind: "linear" }, 35)).toBeCloseTo(0.775);
    expect(learningRate({ ...base, kind: "constant" }, 100)).toBe(1);
  });
});
