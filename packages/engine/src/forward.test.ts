import { describe, expect, it } from "vitest";
import { tinyModel } from "../test/fixtures.ts";
import { naiveLogits } from "../test/naive-reference.ts";
import { createKvCache, forwardBatch } from "./forward.ts";
import { jsKernels } from "./kernels/js.ts";

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
