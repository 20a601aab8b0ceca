import { describe, expect, it } from "vitest";
import { FAMILIES, familyChatFiles } from "../../test/families.ts";
import { jsKernels } from "../kernels/js.ts";
import { createWasmKernels } from "../kernels/wasm.ts";
import { createLoraAdapter, loraHooks, loraParameters, zerosLikeAdapter } from "../model/lora.ts";
import { EngineMemoryError, type WeightStorage } from "../model/memory.ts";
import { type Model, packModel, randomModel } from "../model/model.ts";
import { LoraTrainer } from "./lora-train.ts";
import { planSft, type SftExample, trainSft } from "./sft.ts";
import { lossAndGradients } from "./train.ts";
import { microBatchBudget, rowsThatFit, trainingMemory } from "./train-memory.ts";

const qwen3 = familyChatFiles(FAMILIES.find((f) => f.name === "Qwen3")!);
// Qwen3's vocabulary as its config.json pads it (151,936: whole GEMM panels).
const small = { hidden_size: 64, intermediate_size: 160, num_hidden_layers: 2, vocab_size: 151936 };
const SHAPES: Record<string, Record<string, unknown>> = {
  "llama, untied head": {
    ...small,
    model_type: "llama",
    num_attention_heads: 4,
    num_key_value_heads: 2,
    head_dim: 16,
    tie_word_embeddings: false,
  },
  "qwen2, q/k/v biases": {
    ...small,
    model_type: "qwen2",
    num_attention_heads: 7,
    num_key_value_heads: 1,
    head_dim: 16,
  },
  "qwen3, q/k norms": {
    ...small,
    model_type: "qwen3",
    num_attention_heads: 4,
    num_key_value_heads: 2,
    head_dim: 32,
  },
  "qwen3 whose layers outweigh its head": {
    ...small,
    model_type: "qwen3",
    num_hidden_layers: 8,
    intermediate_size: 4096,
    num_attention_heads: 4,
    num_key_value_heads: 2,
    head_dim: 32,
  },
};
/** Plain arrays (packed beside them), and packed as the only copy in F32 and BF16. */
const STORAGES: WeightStorage[] = ["plain", "f32", "bf16"];
const models = new Map<string, Model>();
const model = (name: string) => {
  const m = models.get(name) ?? randomModel(SHAPES[name]!, qwen3, 1);
  models.set(name, m);
  return m;
};

/** The arena's high-water mark over one LoRA backward of `rows` rows, on fresh kernels (holding
 * the weights packed as their only copy, unless `storage` is "plain"). */
function peakOfBackward(
  plain: Model,
  rows: number,
  storage: WeightStorage,
  recompute = false,
): number {
  const kernels = createWasmKernels("simd");
  const m = storage === "plain" ? plain : packModel(plain, kernels, storage);
  const trainer = new LoraTrainer(m, createLoraAdapter(m, { rank: 4 }, 1), { kernels });
  const inputs = Int32Array.from({ length: rows }, (_, i) => (i * 7919) % 1000);
  trainer.backward(
    {
      batchSize: 1,
      seqLen: rows,
      inputs,
      targets: inputs,
      lossMask: new Float32Array(rows).fill(1),
    },
    { recompute },
  );
  return kernels.peakBytes;
}

describe("training memory", () => {
  for (const [name, storage] of Object.keys(SHAPES).flatMap((name) =>
    STORAGES.map((storage) => [name, storage] as const),
  )) {
    it(`when a ${name} model trains with ${storage} weights, then the arena stays within the estimate, which is not loose per row`, () => {
      const m = model(name);
      const { weights, fixed, perRow } = trainingMemory(m.config, storage);
      const [r1, r2] = [32, 160];
      const p1 = peakOfBackward(m, r1, storage);
      const p2 = peakOfBackward(m, r2, storage);
      expect(p1).toBeLessThanOrEqual(weights + fixed + perRow * r1);
      expect(p2).toBeLessThanOrEqual(weights + fixed + perRow * r2);
      // What a row costs is what the estimate says, within 15 %.
      const measured = (p2 - p1) / (r2 - r1);
      expect(measured).toBeGreaterThan(0.85 * perRow);
      expect(measured).toBeLessThanOrEqual(perRow);
    });
  }

  for (const name of Object.keys(SHAPES)) {
    it(`when a ${name} model trains recomputing its activations, then the arena stays within that estimate, which is not loose per row`, () => {
      const m = model(name);
      const { weights, fixed, perRow, perRowRecompute } = trainingMemory(m.config, "bf16");
      expect(perRowRecompute).toBeLessThan(perRow);
      const [r1, r2] = [32, 160];
      const p1 = peakOfBackward(m, r1, "bf16", true);
      const p2 = peakOfBackward(m, r2, "bf16", true);
      expect(p1).toBeLessThanOrEqual(weights + fixed + perRowRecompute * r1);
      expect(p2).toBeLessThanOrEqual(weights + fixed + perRowRecompute * r2);
      const measured = (p2 - p1) / (r2 - r1);
      expect(measured).toBeGreaterThan(0.85 * perRowRecompute);
      expect(measured).toBeLessThanOrEqual(perRowRecompute);
    });
  }

  it("when activations are recomputed, then the loss and every LoRA gradient are the same bits", () => {
    const m = model("qwen3, q/k norms");
    const kernels = createWasmKernels("simd");
    const inputs = Int32Array.from({ length: 40 }, (_, i) => (i * 7919) % 1000);
    const batch = {
      batchSize: 2,
      seqLen: 20,
      inputs,
      targets: inputs.map((t) => (t + 1) % 1000),
      lossMask: new Float32Array(40).map((_, i) => (i % 3 === 0 ? 0 : 1)),
    };
    const adapter = createLoraAdapter(m, { rank: 4 }, 1);
    for (const p of loraParameters(adapter)) p.data.fill(0.05);
    const run = (recompute: boolean) => {
      const grads = zerosLikeAdapter(adapter);
      const { loss } = lossAndGradients(m, kernels, batch, null, {
        hooks: loraHooks(adapter, kernels, grads),
        recompute,
        maskedRowsOnly: true,
      });
      return { loss, grads: loraParameters(grads).map((p) => Array.from(p.data)) };
    };
    const saved = run(false);
    expect(run(true)).toEqual(saved);
    expect(saved.grads.some((g) => g.some((v) => v !== 0))).toBe(true);
  });

  it("when only recomputing fits, then a Memory64 arena recomputes and trains, and a wasm32 one refuses so the work can move", async () => {
    const m = model("qwen3 whose layers outweigh its head");
    const { weights, fixed, perRow, perRowRecompute } = trainingMemory(m.config);
    // Room for 80 rows recomputed, 80 · perRowRecompute / perRow saved (fewer than 60).
    const memoryLimit = weights + fixed + perRowRecompute * 80;
    expect(Math.floor((perRowRecompute * 80) / perRow)).toBeLessThan(60);
    const sequences = [{ tokens: new Array(60) }];
    const wide = createWasmKernels("simd", { memory64: true, memoryLimit });
    const plan = microBatchBudget(m.config, wide, sequences, 4096);
    expect(plan.recompute).toBe(true);
    // About 80 rows (the limit is rounded down to whole pages).
    expect(plan.tokens).toBeGreaterThanOrEqual(60);
    const narrow = createWasmKernels("simd", { memoryLimit });
    expect(() => microBatchBudget(m.config, narrow, sequences, 4096)).toThrow(EngineMemoryError);
    const examples: SftExample[] = [
      {
        messages: [
          { role: "user", content: "Count to ten, please, and say it in words as well." },
          { role: "assistant", content: "one two three four five six seven eight nine ten" },
          { role: "user", content: "And back from ten, please." },
          { role: "assistant", content: "ten nine eight seven six five four three two one" },
        ],
      },
    ];
    // The example needs the recomputing: longer than saved activations allow, within plan.tokens.
    const length = planSft(m, examples, { batchSize: 1 }).prepared.sequences[0]!.tokens.length;
    expect(length).toBeGreaterThan(rowsThatFit(m.config, wide));
    expect(length).toBeLessThanOrEqual(plan.tokens);
    const result = await trainSft(m, examples, { batchSize: 1, epochs: 2 }, { kernels: wide });
    expect(result.steps).toHaveLength(2);
    expect(Number.isFinite(result.steps[1]!.loss)).toBe(true);
    expect(wide.peakBytes).toBeLessThanOrEqual(memoryLimit);
  });

  it("when memory is unbounded, then the budget asked for is kept", () => {
    const m = model("qwen3, q/k norms");
    expect(rowsThatFit(m.config, jsKernels)).toBe(Number.POSITIVE_INFINITY);
    expect(microBatchBudget(m.config, jsKernels, [{ tokens: new Array(100) }], 4096)).toEqual({
      tokens: 4096,
      recompute: false,
    });
  });

  it("when the arena holds fewer rows than the budget, then micro-batches shrink to fit, and training stays within it", async () => {
    const m = model("qwen3, q/k norms");
    const { weights, fixed, perRow } = trainingMemory(m.config);
    // Room for 300 rows: four 60-token examples are 240; the default budget is 4,096.
    const kernels = createWasmKernels("simd", { memoryLimit: weights + fixed + perRow * 300 });
    expect(
      microBatchBudget(m.config, kernels, [{ tokens: new Array(60) }], 4096).tokens,
    ).toBeLessThan(320);
    const examples: SftExample[] = Array.from({ length: 8 }, (_, i) => ({
      messages: [
        { role: "user", content: `Count to ${i + 3}, please, and say it in words as well.` },
        { role: "assistant", content: "one two three four five six seven eight nine ten" },
      ],
    }));
    const result = await trainSft(m, examples, { batchSize: 8, epochs: 1 }, { kernels });
    expect(result.steps).toHaveLength(1);
    expect(Number.isFinite(result.steps[0]!.loss)).toBe(true);
    expect(kernels.peakBytes).toBeLessThanOrEqual(kernels.memoryLimit);
  });

  it("when even the longest sequence cannot fit, then training fails before its first step, naming the memory needed and available", async () => {
    const m = model("qwen3, q/k norms");
    const { weights, fixed, perRow } = trainingMemory(m.config);
    const kernels = createWasmKernels("simd", { memoryLimit: weights + fixed + perRow * 10 });
    const steps: unknown[] = [];
    const examples: SftExample[] = [
      {
        messages: [
          { role: "user", content: "A question long enough to need more than ten rows." },
          { role: "assistant", content: "An answer." },
        ],
      },
    ];
    const run = trainSft(
      m,
      examples,
      { batchSize: 1 },
      { kernels, onStep: (s) => void steps.push(s) },
    );
    await expect(run).rejects.toThrow(EngineMemoryError);
    await expect(run).rejects.toThrow(/needs \d+\.\d\d GB .* the engine has \d+\.\d\d GB/);
    expect(steps).toEqual([]);
  });
});
