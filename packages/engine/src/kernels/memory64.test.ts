import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { randomBatch, tinyModel } from "../../test/fixtures.ts";
import { createKvCache, forwardBatch } from "../model/forward.ts";
import { ggufBytes } from "../model/gguf.ts";
import { createLoraAdapter, loraHooks, loraParameters, zerosLikeAdapter } from "../model/lora.ts";
import { loadModel, type Model, packModel, saveModel } from "../model/model.ts";
import { Rng } from "../model/rng.ts";
import { lossAndGradients } from "../train/train.ts";
import type { Kernels } from "./types.ts";
import { ARENA_LIMIT, createWasmKernels } from "./wasm.ts";

function logits(model: Model, kernels: Kernels): Float32Array[] {
  return forwardBatch(
    model,
    kernels,
    [[1, 5, 9, 200, 17], [3, 4], [7]].map((tokens) => ({
      cache: createKvCache(model, 16),
      tokens,
    })),
  );
}

function gradients(model: Model, kernels: Kernels) {
  const adapter = createLoraAdapter(model, { rank: 3, alpha: 6 }, 4);
  const rng = new Rng(5);
  for (const p of loraParameters(adapter)) {
    for (let i = 0; i < p.data.length; i++) p.data[i] = rng.normal() * 0.1;
  }
  const grads = zerosLikeAdapter(adapter);
  const { loss } = lossAndGradients(
    model,
    kernels,
    randomBatch(model.config.vocabSize, 2, 9, 3),
    null,
    { hooks: loraHooks(adapter, kernels, grads) },
  );
  return { loss, grads: loraParameters(grads).map((p) => Array.from(p.data)) };
}

describe("a Memory64 arena", () => {
  it("when a model's weights and activations lie past 4 GiB, then its logits, readback and LoRA gradients are the wasm32 arena's, bit for bit, on helper threads too", async () => {
    const dir = await mkdtemp(join(tmpdir(), "arbor-memory64-"));
    try {
      await saveModel(tinyModel(3, { intermediateSize: 44 }), dir, { dtype: "BF16" });
      const narrow = createWasmKernels("auto", { threads: 2 });
      const wide = createWasmKernels("auto", { threads: 2, memory64: true });
      expect(wide.name).toMatch(/-memory64$/);
      // 4 GiB of the arena taken first (a weight never written: its pages stay untouched, so
      // they cost no memory): everything the model packs and computes lies above.
      const filler = wide.packWeight(65536, 16384, "f32");
      expect(filler.bytes).toBe(ARENA_LIMIT);
      for (const dtype of ["f32", "bf16"] as const) {
        const inNarrow = await loadModel(dir, { kernels: narrow, weights: dtype });
        const inWide = await loadModel(dir, { kernels: wide, weights: dtype });
        expect(wide.memory.buffer.byteLength).toBeGreaterThan(ARENA_LIMIT);
        expect(logits(inWide, wide)).toEqual(logits(inNarrow, narrow));
        expect(ggufBytes(inWide)).toEqual(ggufBytes(inNarrow));
        expect(gradients(inWide, wide)).toEqual(gradients(inNarrow, narrow));
        // Packing plain weights there (the training path's panels) gives the same numbers too.
        const plain = await loadModel(dir);
        expect(logits(packModel(plain, wide, dtype), wide)).toEqual(logits(inNarrow, narrow));
        // Calls large enough to be shared with the helper threads (whose integers arrive as f64
        // as well) give the same bits.
        const rng = new Rng(9);
        const [M, N, K] = [64, 300, 520];
        const a = Float32Array.from({ length: M * K }, () => rng.normal());
        const w = Float32Array.from({ length: N * K }, () => rng.normal());
        const run = (kernels: Kernels) => {
          const out = new Float32Array(M * N);
          kernels.matmulNT(out, a, w, M, N, K, false, 1);
          const back = new Float32Array(M * K);
          kernels.matmulNN(back, out, w, M, K, N, false, 1);
          return [out, back];
        };
        const splits = wide.splitCalls;
        expect(run(wide)).toEqual(run(narrow));
        expect(wide.splitCalls).toBeGreaterThan(splits);
      }
      filler.release();
      await Promise.all([narrow.close(), wide.close()]);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});
