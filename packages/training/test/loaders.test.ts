import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createWasmKernels } from "@arbor/engine/kernels";
import {
  catalogModelDir,
  createKvCache,
  forwardBatch,
  loadModel,
  type Model,
  saveModel,
} from "@arbor/engine/model";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { baseModels } from "../src/runner/loaders.ts";

const forward = (model: Model, kernels: ReturnType<typeof createWasmKernels>) =>
  forwardBatch(model, kernels, [{ cache: createKvCache(model, 8), tokens: [1, 2, 3] }])[0]!;

describe("baseModels", () => {
  let modelsDir: string;
  beforeAll(async () => {
    modelsDir = await mkdtemp(join(tmpdir(), "arbor-loaders-"));
    await saveModel(
      await loadModel(catalogModelDir("arbor/tiny-chat")),
      join(modelsDir, "test", "tiny"),
    );
  });
  afterAll(() => rm(modelsDir, { recursive: true, force: true }));

  it("when kernels load another base model, then the previous one's packed weights are freed, and each kernel set keeps its own", async () => {
    const load = baseModels(modelsDir, { weights: "bf16" });
    const kernels = createWasmKernels("simd");
    const other = createWasmKernels("simd");
    const shipped = await load("arbor/tiny-chat", kernels);
    expect(shipped.storage).toBe("bf16");
    expect(await load("arbor/tiny-chat", kernels)).toBe(shipped);
    const elsewhere = await load("arbor/tiny-chat", other);
    expect(elsewhere).not.toBe(shipped);
    const expected = forward(shipped, kernels);

    const folder = await load("test/tiny", kernels);
    expect(() => forward(shipped, kernels)).toThrow(/a released weight was used/);
    // The same weights from the folder: the same logits; the other kernels' copy is untouched.
    expect(forward(folder, kernels)).toEqual(expected);
    expect(forward(elsewhere, other)).toEqual(expected);
    await expect(load("nobody/none", kernels)).rejects.toThrow();
  });
});
