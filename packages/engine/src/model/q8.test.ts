import { describe, expect, it } from "vitest";
import { randomBatch } from "../../test/fixtures.ts";
import type { Kernels } from "../kernels/types.ts";
import { createWasmKernels } from "../kernels/wasm.ts";
import { isWeightSource } from "../kernels/weight.ts";
import { trainSft } from "../train/sft.ts";
import { lossAndGradients } from "../train/train.ts";
import { catalogModelDir } from "./catalog.ts";
import { createLoraAdapter, loraHooks, loraParameters, zerosLikeAdapter } from "./lora.ts";
import { packedWeightBytes } from "./memory.ts";
import { loadModel, type Model } from "./model.ts";
import { distributionDistance, positionLogits, QUALITY_TEXT } from "./quality.ts";
import { Rng } from "./rng.ts";
import { parameters } from "./weights.ts";

const tinyDir = catalogModelDir("arbor/tiny-chat");

function adapterGradients(model: Model, kernels: Kernels) {
  const adapter = createLoraAdapter(model, { rank: 4, alpha: 8 }, 4);
  const rng = new Rng(5);
  for (const p of loraParameters(adapter)) {
    for (let i = 0; i < p.data.length; i++) p.data[i] = rng.normal() * 0.05;
  }
  const grads = zerosLikeAdapter(adapter);
  const { loss } = lossAndGradients(
    model,
    kernels,
    randomBatch(model.config.vocabSize, 4, 24, 3),
    null,
    { hooks: loraHooks(adapter, kernels, grads) },
  );
  return { loss, grads: loraParameters(grads).map((p) => p.data) };
}

describe("a model with q8 weights", () => {
  it("when the shipped tiny model is loaded in q8, then every weight matrix is q8 in 9 bits a weight, and its next-token distributions over a fixed text stay within 1e-3 of BF16's and F32's (mean KL)", async () => {
    const kernels = createWasmKernels("auto");
    const f32 = await loadModel(tinyDir, { kernels, weights: "f32" });
    const bf16 = await loadModel(tinyDir, { kernels, weights: "bf16" });
    const before = kernels.usedBytes;
    const q8 = await loadModel(tinyDir, { kernels, weights: "q8" });
    expect(q8.storage).toBe("q8");
    for (const p of parameters(q8.config, q8.weights)) {
      if (p.shape.length === 2) {
        expect(isWeightSource(p.data) && "dtype" in p.data && p.data.dtype, p.name).toBe("q8");
      }
    }
    // The arena holds what the memory plan counts (blocks are rounded to 64 bytes).
    const planned = packedWeightBytes(q8.config, "q8");
    expect(planned).toBeCloseTo((packedWeightBytes(q8.config, "bf16") * 9) / 16, -3);
    expect(kernels.usedBytes - before).toBeGreaterThanOrEqual(planned);
    expect(kernels.usedBytes - before).toBeLessThan(planned + 64 * 64);

    const tokens = f32.tokenizer.encode(QUALITY_TEXT, { special: false }).slice(0, 255);
    expect(tokens.length).toBe(255);
    const reference = positionLogits(f32, kernels, tokens);
    const rounded = positionLogits(bf16, kernels, tokens);
    const quantized = positionLogits(q8, kernels, tokens);
    const fromBf16 = distributionDistance(rounded, quantized);
    const fromF32 = distributionDistance(reference, quantized);
    expect(fromBf16.meanKld).toBeLessThan(1e-3);
    expect(fromF32.meanKld).toBeLessThan(1e-3);
    expect(fromBf16.top1).toBeGreaterThan(0.95);
    // Quantizing does change the numbers (else the bound would be vacuous).
    expect(fromF32.meanKld).toBeGreaterThan(1e-6);
  });

  // The tolerance: a q8 weight is its BF16 value within half a step of max|w|/127 (about 0.2%
  // rms of a block's largest weight), and every GEMM quantizes its input again to 8 bits; over
  // four layers, forward and backward, that moves the adapter's gradients by 1.4–6% per tensor
  // (measured): the bounds are about twice that, and a gradient of the
  // wrong sign or scale (a broken backward through the q8 weights) is off by 100% or more.
  it("when LoRA gradients are taken on a q8 base, then they are the BF16 base's within 5% over all (relative L2), 12% per tensor", async () => {
    const kernels = createWasmKernels("auto");
    const bf16 = adapterGradients(await loadModel(tinyDir, { kernels, weights: "bf16" }), kernels);
    const q8 = adapterGradients(await loadModel(tinyDir, { kernels, weights: "q8" }), kernels);
    expect(Math.abs(q8.loss - bf16.loss) / bf16.loss).toBeLessThan(0.01);
    let diffAll = 0;
    let normAll = 0;
    bf16.grads.forEach((want, i) => {
      const got = q8.grads[i]!;
      let diff = 0;
      let norm = 0;
      for (let j = 0; j < want.length; j++) {
        diff += (got[j]! - want[j]!) ** 2;
        norm += want[j]! ** 2;
      }
      expect(norm).toBeGreaterThan(0);
      expect(Math.sqrt(diff / norm), `adapter tensor ${i}`).toBeLessThan(0.12);
      diffAll += diff;
      normAll += norm;
    });
    expect(Math.sqrt(diffAll / normAll)).toBeLessThan(0.05);
  });

  it("when LoRA SFT runs on a q8 base, then the loss falls", async () => {
    const kernels = createWasmKernels("auto");
    const model = await loadModel(tinyDir, { kernels, weights: "q8" });
    const examples = Array.from({ length: 16 }, (_, i) => ({
      messages: [
        { role: "user" as const, content: `What is ${i} + ${i}?` },
        { role: "assistant" as const, content: `{"answer": ${2 * i}}` },
      ],
    }));
    const { steps } = await trainSft(
      model,
      examples,
      { learningRate: 3e-3, batchSize: 8, epochs: 6, seed: 1, lora: { rank: 8, alpha: 16 } },
      { kernels },
    );
    const first = steps[0]!.loss;
    const last = steps.at(-1)!.loss;
    expect(last).toBeLessThan(first * 0.7);
  });
});
