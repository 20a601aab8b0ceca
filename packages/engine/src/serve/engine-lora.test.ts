import { describe, expect, it } from "vitest";
import { tinyModel } from "../../test/fixtures.ts";
import { createWasmKernels } from "../kernels/wasm.ts";
import { catalogModelDir } from "../model/catalog.ts";
import { createLoraAdapter, loraParameters, loraRowHooks } from "../model/lora.ts";
import { loadModel } from "../model/model.ts";
import { Rng } from "../model/rng.ts";
import { trainSft } from "../train/sft.ts";
import { Engine } from "./engine.ts";

describe("Engine with LoRA adapters", () => {
  it("when adapters are served side by side, then the identity adapter equals the base and a trained one changes the answer", async () => {
    const model = await loadModel(catalogModelDir("arbor/tiny-chat"));
    const engine = new Engine(model);
    const messages = [{ role: "user" as const, content: "What is 3 + 4?" }];
    const identity = createLoraAdapter(model, { rank: 4 }, 5);
    const { adapter: trained } = await trainSft(
      model,
      Array.from({ length: 8 }, () => ({
        messages: [...messages, { role: "assistant", content: "Banana banana." }],
      })),
      { learningRate: 1e-2, batchSize: 4, epochs: 5, schedule: "constant", seed: 3 },
    );
    const request = { messages, temperature: 0.7, seed: 11, maxTokens: 12, logprobs: true };
    // All three in flight at once: they share each forward pass.
    const [base, same, changed] = await Promise.all([
      engine.complete(request),
      engine.complete({ ...request, adapter: identity }),
      engine.complete({ ...request, adapter: trained }),
    ]);
    expect(engine.stats.maxBatch).toBeGreaterThanOrEqual(3);
    expect(same.choices[0]!.tokens).toEqual(base.choices[0]!.tokens);
    expect(same.choices[0]!.logprobs).toEqual(base.choices[0]!.logprobs);
    expect(changed.choices[0]!.text).not.toBe(base.choices[0]!.text);
    expect(changed.choices[0]!.text).toContain("banana.");
    // Alone, the adapted request gives the same answer as in the mixed batch.
    const alone = await engine.complete({ ...request, adapter: trained });
    expect(alone.choices[0]!.tokens).toEqual(changed.choices[0]!.tokens);
    // An adapter made for another base model is refused up front.
    const foreign = createLoraAdapter({ config: { ...model.config, numLayers: 2 } }, { rank: 4 });
    expect(() => engine.generate({ ...request, adapter: foreign })).toThrow(/2 layers/);
  });
});

describe("loraRowHooks", () => {
  it("when sequences with one adapter are not adjacent in the batch, then each row gets the same update as alone", () => {
    const model = tinyModel(51);
    const kernels = createWasmKernels();
    const rng = new Rng(2);
    const [a, b] = [
      createLoraAdapter(model, { rank: 3 }, 1),
      createLoraAdapter(model, { rank: 2 }, 2),
    ];
    for (const adapter of [a, b]) {
      for (const p of loraParameters(adapter))
        for (let i = 0; i < p.data.length; i++) p.data[i] = rng.normal();
    }
    const D = model.config.hiddenSize;
    const Q = model.config.numHeads * model.config.headDim;
    const items = [
      { tokens: [1, 2, 3], adapter: a },
      { tokens: [4, 5], adapter: b },
      { tokens: [6], adapter: null },
      { tokens: [7, 8], adapter: a },
    ];
    const x = Float32Array.from({ length: 8 * D }, () => rng.normal());
    const mixed = new Float32Array(8 * Q);
    loraRowHooks(kernels, items).forward(0, "q", mixed, x, 8);
    let row = 0;
    for (const item of items) {
      const n = item.tokens.length;
      const alone = new Float32Array(n * Q);
      loraRowHooks(kernels, [item]).forward(0, "q", alone, x.subarray(row * D, (row + n) * D), n);
      expect(mixed.subarray(row * Q, (row + n) * Q)).toEqual(alone);
      if (!item.adapter) expect(alone.every((v) => v === 0)).toBe(true);
      else expect(alone.some((v) => v !== 0)).toBe(true);
      row += n;
    }
  });
});
