import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { randomBatch, tinyModel } from "../../test/fixtures.ts";
import { jsKernels } from "../kernels/js.ts";
import type { Kernels } from "../kernels/types.ts";
import { createWasmKernels } from "../kernels/wasm.ts";
import { isWeightSource, weightArray } from "../kernels/weight.ts";
import { Trainer } from "../train/optim.ts";
import { lossAndGradients } from "../train/train.ts";
import { checkModelFolder } from "./folders.ts";
import { createKvCache, forwardBatch } from "./forward.ts";
import { ggufBytes } from "./gguf.ts";
import {
  createLoraAdapter,
  loraHooks,
  loraParameters,
  mergeAdapter,
  zerosLikeAdapter,
} from "./lora.ts";
import {
  loadModel,
  type Model,
  packModel,
  parameterCount,
  releaseModel,
  saveModel,
} from "./model.ts";
import { Rng } from "./rng.ts";
import { parameters } from "./weights.ts";

// Odd sizes: the vocabulary (300) and the MLP (44) are not whole 8-row panels, nor is K of the
// down projection a multiple of 8.
const overrides = { intermediateSize: 44 };

function logits(model: Model, kernels = createWasmKernels("simd")): Float32Array[] {
  const prompts = [
    [1, 5, 9, 200, 17],
    [3, 4],
  ];
  return forwardBatch(
    model,
    kernels,
    prompts.map((tokens) => ({ cache: createKvCache(model, 16), tokens })),
  );
}

function adapterGradients(model: Model, kernels: Kernels = createWasmKernels("simd")) {
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
    {
      hooks: loraHooks(adapter, kernels, grads),
    },
  );
  return { loss, grads: loraParameters(grads).map((p) => Array.from(p.data)) };
}

describe.each(["f32", "bf16"] as const)(
  "weights packed in the kernels as their only copy (%s)",
  (dtype) => {
    let dir: string;
    // The reference: the same numbers as plain F32 arrays (for BF16, the folder's BF16 weights
    // widened), computed by the same kernels.
    let plain: Model<Float32Array>;
    beforeAll(async () => {
      dir = await mkdtemp(join(tmpdir(), "arbor-packed-"));
      await saveModel(tinyModel(3, overrides), dir, { dtype: dtype === "bf16" ? "BF16" : "F32" });
      plain = await loadModel(dir);
    });
    afterAll(() => rm(dir, { recursive: true, force: true }));

    it("when a folder is loaded into kernels, then no weight matrix stays a plain array, every tensor reads back exactly, and the logits are the plain model's, bit for bit", async () => {
      const kernels = createWasmKernels("simd");
      const packed = await loadModel(dir, { kernels, weights: dtype });
      expect(packed.storage).toBe(dtype);
      const plainParams = parameters(plain.config, plain.weights);
      const packedParams = parameters(packed.config, packed.weights);
      expect(packedParams.map((p) => p.name)).toEqual(plainParams.map((p) => p.name));
      packedParams.forEach((p, i) => {
        expect(isWeightSource(p.data), p.name).toBe(p.shape.length === 2);
        expect(weightArray(p.data), p.name).toEqual(plainParams[i]!.data);
      });
      expect(logits(packed, kernels)).toEqual(logits(plain));
    });

    it("when a packed model is exported, merged or trained, then it gives the plain model's bytes and gradients", async () => {
      const kernels = createWasmKernels("simd");
      const packed = packModel(plain, kernels, dtype);
      expect(ggufBytes(packed)).toEqual(ggufBytes(plain));
      const adapter = createLoraAdapter(plain, { rank: 2, alpha: 4 }, 9);
      for (const p of loraParameters(adapter)) p.data.fill(0.05);
      const mergedPacked = mergeAdapter(packed, adapter);
      const mergedPlain = mergeAdapter(plain, adapter);
      expect(ggufBytes(mergedPacked)).toEqual(ggufBytes(mergedPlain));
      // The merge changed the adapted weights (the test would pass vacuously otherwise).
      expect(ggufBytes(mergedPlain)).not.toEqual(ggufBytes(plain));
      // Backward through packed weights (dX = dY·W from the W-panels) and on other kernels.
      const reference = adapterGradients(plain);
      expect(adapterGradients(packed, kernels)).toEqual(reference);
      // In slabs of 16 rows of W at a time (the head's 300 rows: 19 slabs, the last partial).
      kernels.bSlabBytes = 16 * 32 * Math.ceil(plain.config.hiddenSize / 8);
      expect(adapterGradients(packed, kernels)).toEqual(reference);
      const js = adapterGradients(packed, jsKernels);
      expect(js.loss).toBeCloseTo(reference.loss, 4);
    });

    it("when a packed model is given to full fine-tuning, then it is refused by name", () => {
      const packed = packModel(plain, createWasmKernels("simd"), dtype);
      expect(
        () =>
          new Trainer(packed as Model<Float32Array>, jsKernels, {
            schedule: { kind: "constant", peak: 1e-3, warmupSteps: 0, totalSteps: 1 },
          }),
      ).toThrow(/full fine-tuning needs the weights as plain F32 arrays/);
    });
  },
);

describe("BF16 packing", () => {
  it("when F32 weights are packed in BF16, then each rounds to the nearest BF16 as a BF16 file stores it, and relaxed SIMD computes on them too", async () => {
    const model = tinyModel(5, overrides);
    const dir = await mkdtemp(join(tmpdir(), "arbor-packed-"));
    try {
      await saveModel(model, dir, { dtype: "BF16" });
      const rounded = await loadModel(dir);
      for (const variant of ["simd", "relaxed"] as const) {
        const kernels = createWasmKernels(variant);
        const packed = packModel(model, kernels, "bf16");
        const a = parameters(packed.config, packed.weights);
        parameters(rounded.config, rounded.weights).forEach((p, i) => {
          if (p.shape.length === 2) expect(weightArray(a[i]!.data), p.name).toEqual(p.data);
        });
        expect(logits(packed, kernels)).toEqual(logits(rounded, createWasmKernels(variant)));
      }
      // Rounding happened: F32 weights are not all BF16 numbers.
      expect(weightArray(rounded.weights.layers[0]!.q)).not.toEqual(model.weights.layers[0]!.q);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe("packed weights' memory", () => {
  it("when a packed model is released, then its arena blocks are reused and using it throws", async () => {
    const dir = await mkdtemp(join(tmpdir(), "arbor-packed-"));
    try {
      await saveModel(tinyModel(6, overrides), dir, { dtype: "BF16" });
      const kernels = createWasmKernels("simd");
      const first = await loadModel(dir, { kernels, weights: "bf16" });
      const expected = logits(first, kernels);
      const peak = kernels.peakBytes;
      releaseModel(first);
      expect(() => logits(first, kernels)).toThrow(/a released weight was used/);
      for (let i = 0; i < 5; i++) {
        const again = await loadModel(dir, { kernels, weights: "bf16" });
        expect(logits(again, kernels)).toEqual(expected);
        releaseModel(again);
      }
      // Each load took the blocks the last one freed: the arena never grew past the first.
      expect(kernels.peakBytes).toBe(peak);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it("when a folder's packed weights exceed the kernels' memory, then it is refused before its weights are read, naming both sizes", async () => {
    const dir = await mkdtemp(join(tmpdir(), "arbor-packed-"));
    try {
      await saveModel(tinyModel(6, overrides), dir);
      const config = JSON.parse(await readFile(join(dir, "config.json"), "utf8"));
      await writeFile(
        join(dir, "config.json"),
        JSON.stringify({ ...config, hidden_size: 2048, intermediate_size: 8192 }),
      );
      await rm(join(dir, "model.safetensors"));
      const kernels = createWasmKernels("simd", { memoryLimit: 64 << 20 });
      await expect(loadModel(dir, { kernels, weights: "bf16" })).rejects.toThrow(
        /config\.json: too large for the engine: its weights take 0\.\d\d GB packed in BF16, and the engine's memory holds 0\.07 GB/,
      );
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe("weights: auto", () => {
  it("when a folder is loaded with weights auto, then BF16 files are packed in BF16 and F32 files in F32, never rounded", async () => {
    const dir = await mkdtemp(join(tmpdir(), "arbor-packed-"));
    try {
      for (const [file, storage] of [
        ["BF16", "bf16"],
        ["F32", "f32"],
      ] as const) {
        const folder = join(dir, file);
        await saveModel(tinyModel(8, overrides), folder, { dtype: file });
        const kernels = createWasmKernels("simd");
        const packed = await loadModel(folder, { kernels, weights: "auto" });
        expect(packed.storage).toBe(storage);
        expect(logits(packed, kernels)).toEqual(logits(await loadModel(folder)));
        const checked = await checkModelFolder(folder, { weights: "auto" });
        expect(checked.parameters).toBe(parameterCount(packed));
      }
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});
