import { describe, expect, it } from "vitest";
import { tinyModel } from "../../test/fixtures.ts";
import { naiveLogits } from "../../test/naive-reference.ts";
import { jsKernels } from "../kernels/js.ts";
import { createWasmKernels } from "../kernels/wasm.ts";
import { Engine } from "../serve/engine.ts";
import { createKvCache, forwardBatch, releaseKvCache } from "./forward.ts";

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

  it("when the cache lives in the kernels' memory, then prefill, decode and growth past its first allocation give the plain cache's bits, growing and releasing free exactly its bytes, and attention reads it in place", () => {
    const model = tinyModel(4, { maxPositions: 512 });
    const kvBytes = (positions: number) =>
      2 * model.config.numLayers * positions * model.config.numKvHeads * model.config.headDim * 4;
    // The same kernel code on two sets: one for the arena cache, one for the plain cache (whose
    // arena mirrors would otherwise count in the first's use).
    const kernels = createWasmKernels("simd", { threads: 2 });
    const other = createWasmKernels("simd", { threads: 2 });
    const warm = createKvCache(model, 16, kernels);
    forwardBatch(model, kernels, [{ cache: warm, tokens: [1, 2, 3] }]);
    releaseKvCache(warm);
    const base = kernels.usedBytes; // the packed weights
    const plain = createKvCache(model, 400);
    const arena = createKvCache(model, 400, kernels);
    expect(arena.kernels).toBe(kernels);
    expect(kernels.usedBytes - base).toBe(kvBytes(256));
    const tokens = Array.from({ length: 300 }, (_, i) => (i * 37) % model.config.vocabSize);
    // A 200-token prefill, then single tokens past the first 256 positions (the cache grows).
    const steps = [tokens.slice(0, 200), ...tokens.slice(200).map((t) => [t])];
    for (const step of steps) {
      const [a] = forwardBatch(model, other, [{ cache: plain, tokens: step }]);
      const [b] = forwardBatch(model, kernels, [{ cache: arena, tokens: step }]);
      expect(b).toEqual(a);
    }
    // Grown to 400 positions, the old arrays freed, and no mirror of the cache made.
    expect(kernels.usedBytes - base).toBe(kvBytes(400));
    releaseKvCache(arena);
    expect(kernels.usedBytes).toBe(base);
    void kernels.close();
    void other.close();
  });

  it("when the memory runs out as a cache grows, then the cache stays as it was, and releasing it frees it all", () => {
    const model = tinyModel(4, { maxPositions: 512 });
    const kernels = createWasmKernels("simd");
    const warm = createKvCache(model, 16, kernels);
    forwardBatch(model, kernels, [{ cache: warm, tokens: [1, 2, 3] }]);
    releaseKvCache(warm);
    const base = kernels.usedBytes;
    const cache = createKvCache(model, 400, kernels);
    const tokens = Array.from({ length: 250 }, (_, i) => (i * 11) % model.config.vocabSize);
    forwardBatch(model, kernels, [{ cache, tokens }]);
    // The third array of the growth fails, as when the arena cannot grow.
    const array = kernels.array.bind(kernels);
    let calls = 0;
    kernels.array = (n: number) => {
      if (++calls === 3)
        throw new RangeError("WebAssembly.Memory.grow(): Maximum memory size exceeded");
      return array(n);
    };
    const kept = [...cache.keys, ...cache.values];
    expect(() => forwardBatch(model, kernels, [{ cache, tokens: tokens.slice(0, 10) }])).toThrow(
      /Maximum memory size exceeded/,
    );
    expect([...cache.keys, ...cache.values]).toEqual(kept);
    expect(cache.length).toBe(250);
    releaseKvCache(cache);
    expect(kernels.usedBytes).toBe(base);
  });

  it("when an engine finishes, cancels or refuses its requests, then their caches' memory is free again", async () => {
    const model = tinyModel(5);
    const kernels = createWasmKernels("simd");
    const engine = new Engine(model, { kernels });
    const run = async (maxTokens: number, signal?: AbortSignal) => {
      const events = engine.generate({ prompt: [1, 2, 3, 4], maxTokens, n: 3 }, { signal });
      for await (const _ of events);
    };
    await run(12);
    const held = kernels.usedBytes;
    for (let i = 0; i < 3; i++) await run(12);
    expect(kernels.usedBytes).toBe(held);
    // Cancelled before its first step, and asking for no tokens at all.
    const controller = new AbortController();
    const cancelled = run(200, controller.signal);
    controller.abort();
    await expect(cancelled).rejects.toBeDefined();
    await run(0);
    await run(1);
    expect(kernels.usedBytes).toBe(held);
    await engine.dispose();
  });
});
