import { describe, expect, it } from "vitest";
import { tinyModel } from "../test/fixtures.ts";
import { naiveLogits } from "../test/naive-reference.ts";
import { Engine } from "./engine.ts";
import { createKvCache, forwardBatch, releaseKvCache } from "./forward.ts";
import { jsKernels } from "./kernels/js.ts";
import { createWasmKernels } from "./kernels/wasm.ts";

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

  it("when the cache lives in the kernels' memory, then prefill, decode and growth past its first allocation give the plain cache's bits, and releasing it returns the memory", () => {
    const model = tinyModel(4, { maxPositions: 512 });
    const kernels = createWasmKernels("simd", { threads: 2 });
    const before = kernels.usedBytes;
    const plain = createKvCache(model, 400);
    const arena = createKvCache(model, 400, kernels);
    expect(arena.kernels).toBe(kernels);
    const tokens = Array.from({ length: 300 }, (_, i) => (i * 37) % model.config.vocabSize);
    // A 200-token prefill, then single tokens past the first 256 positions (the cache grows).
    const steps = [tokens.slice(0, 200), ...tokens.slice(200).map((t) => [t])];
    for (const step of steps) {
      const [a] = forwardBatch(model, kernels, [{ cache: plain, tokens: step }]);
      const [b] = forwardBatch(model, kernels, [{ cache: arena, tokens: step }]);
      expect(b).toEqual(a);
    }
    expect(arena.keys[0]!.length).toBeGreaterThan(
      256 * model.config.numKvHeads * model.config.headDim,
    );
    expect(kernels.usedBytes).toBeGreaterThan(before);
    releaseKvCache(arena);
    releaseKvCache(plain);
    // What is left is the packed weights of the first forward, and the plain cache's mirror.
    const held = kernels.usedBytes;
    const again = createKvCache(model, 400, kernels);
    releaseKvCache(again);
    expect(kernels.usedBytes).toBe(held);
    void kernels.close();
  });

  it("when an engine finishes its requests, then their caches' memory is free again", async () => {
    const model = tinyModel(5);
    const kernels = createWasmKernels("simd");
    const engine = new Engine(model, { kernels });
    const run = async () => {
      const events = engine.generate({ prompt: [1, 2, 3, 4], maxTokens: 12, n: 3 });
      for await (const _ of events);
    };
    await run();
    const held = kernels.usedBytes;
    for (let i = 0; i < 3; i++) await run();
    expect(kernels.usedBytes).toBe(held);
    await engine.dispose();
  });
});
