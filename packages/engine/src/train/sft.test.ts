import { describe, expect, it } from "vitest";
import { jsonAnswerExample } from "../../scripts/synthetic-chat.ts";
import { tinyModel } from "../../test/fixtures.ts";
import { jsKernels } from "../kernels/js.ts";
import { catalogModelDir } from "../model/catalog.ts";
import {
  adapterToFiles,
  cloneAdapter,
  createLoraAdapter,
  type LoraAdapter,
} from "../model/lora.ts";
import { loadModel } from "../model/model.ts";
import { Rng } from "../model/rng.ts";
import { Engine } from "../serve/engine.ts";
import { learningRate } from "./optim.ts";
import { evaluateSft, planSft, type SftExample, sftSequences, trainSft } from "./sft.ts";
import { TrainingInputError } from "./training-data.ts";

const chat = (q: string, a: string): SftExample => ({
  messages: [
    { role: "user", content: q },
    { role: "assistant", content: a },
  ],
});

const examples: SftExample[] = [
  chat("Hello there!", "The cat sat."),
  chat("What is 7 + 5?", "7 + 5 = 12."),
  {
    messages: [
      { role: "system", content: "Be short." },
      { role: "user", content: "Reverse apple" },
      { role: "assistant", content: "elppa" },
      { role: "user", content: "Uppercase" },
      { role: "assistant", content: "APPLE" },
    ],
  },
  chat("The dog", "sat on the log."),
  chat("JSON", '{"name": "Ada"}'),
];

describe("learningRate with a list", () => {
  it("when a per-step list is given, then step k uses entry k and the last entry holds after", () => {
    const schedule = { kind: "cosine" as const, peak: 1, warmupSteps: 5, totalSteps: 10 };
    const values = [0.3, 0.2, 0.1];
    expect([0, 1, 2, 3, 9].map((s) => learningRate({ ...schedule, values }, s))).toEqual([
      0.3, 0.2, 0.1, 0.1, 0.1,
    ]);
  });
});

describe("evaluateSft", () => {
  it("when a fixed adapter is evaluated, then the result is deterministic, does not depend on micro-batches, and equals the training forward's loss on that batch", async () => {
    const model = tinyModel(40);
    const config = { learningRate: 1e-2, batchSize: examples.length, seed: 3, lora: { rank: 2 } };
    const adapter = createLoraAdapter(model, config.lora, config.seed);
    // A fresh adapter's B is zero: move it off, so the adapter takes part in the forward.
    const rng = new Rng(5);
    for (const layer of adapter.layers) {
      for (const m of Object.values(layer)) {
        for (let i = 0; i < m.b.length; i++) m.b[i] = (rng.next() - 0.5) * 0.2;
      }
    }
    const before = adapterToFiles(adapter)["adapter_model.safetensors"];
    const sequences = sftSequences(model, examples);
    const once = evaluateSft(model, adapter, sequences, { kernels: jsKernels });
    const again = evaluateSft(model, adapter, sequences, { kernels: jsKernels });
    expect(again).toEqual(once);
    const split = evaluateSft(model, adapter, sequences, {
      kernels: jsKernels,
      microBatchTokens: 1,
    });
    expect(split.loss).toBeCloseTo(once.loss, 5);
    expect(split.mean_token_accuracy).toBe(once.mean_token_accuracy);
    // Nothing is written to the adapter.
    expect(adapterToFiles(adapter)["adapter_model.safetensors"]).toEqual(before);
    expect(once).toMatchObject({ num_examples: examples.length });
    expect(once.num_trainable_tokens).toBe(sequences.reduce((n, s) => n + s.trainable, 0));
    expect(once.mean_token_accuracy).toBeGreaterThanOrEqual(0);
    expect(once.mean_token_accuracy).toBeLessThanOrEqual(1);
    // One step over the same examples: its loss and accuracy are those of the adapter before it.
    const trained = await trainSft(model, examples, config, {
      kernels: jsKernels,
      adapter: cloneAdapter(adapter),
    });
    expect(trained.steps).toHaveLength(1);
    expect(trained.steps[0]!.loss).toBeCloseTo(once.loss, 5);
    expect(trained.steps[0]!.mean_token_accuracy).toBeCloseTo(once.mean_token_accuracy, 10);
    expect(trained.steps[0]!.num_trainable_tokens).toBe(once.num_trainable_tokens);
  });

  it("when training proceeds, then the evaluated loss on the training data falls and its accuracy does not fall", async () => {
    const model = tinyModel(41);
    const sequences = sftSequences(model, examples);
    const evaluated: { step: number; loss: number; accuracy: number }[] = [];
    const first = createLoraAdapter(model, { rank: 4, alpha: 8 }, 1);
    const start = evaluateSft(model, first, sequences, { kernels: jsKernels });
    evaluated.push({ step: 0, loss: start.loss, accuracy: start.mean_token_accuracy });
    await trainSft(
      model,
      examples,
      { learningRate: 2e-2, batchSize: 5, epochs: 8, seed: 1, schedule: "constant" },
      {
        kernels: jsKernels,
        adapter: first,
        onStep: (p) => {
          if (p.step % 4 !== 0) return;
          const m = evaluateSft(model, p.adapter, sequences, { kernels: jsKernels });
          evaluated.push({ step: p.step, loss: m.loss, accuracy: m.mean_token_accuracy });
        },
      },
    );
    expect(evaluated.map((e) => e.step)).toEqual([0, 4, 8]);
    expect(evaluated[1]!.loss).toBeLessThan(evaluated[0]!.loss);
    expect(evaluated[2]!.loss).toBeLessThan(evaluated[1]!.loss);
    expect(evaluated[2]!.accuracy).toBeGreaterThanOrEqual(evaluated[0]!.accuracy);
  });
});

describe("trainSft", () => {
  it("when batch_size is auto, then steps pack examples by the token budget, every example once per epoch", () => {
    const model = tinyModel(32);
    const { prepared, totalSteps } = planSft(model, examples, {
      batchSize: "auto",
      tokensPerStep: 60,
      epochs: 2,
    });
    for (const epoch of [0, 1]) {
      const seen = prepared.plan.filter((p) => p.epoch === epoch).flatMap((p) => p.examples);
      expect([...seen].sort()).toEqual([0, 1, 2, 3, 4]);
    }
    for (const step of prepared.plan) {
      const longest = Math.max(...step.examples.map((i) => prepared.sequences[i]!.tokens.length));
      if (step.examples.length > 1) expect(step.examples.length * longest).toBeLessThanOrEqual(60);
    }
    expect(totalSteps).toBe(prepared.plan.length);
    // Length grouping: a step's examples have similar lengths, so little of it is padding.
    const mixed = Array.from({ length: 60 }, (_, i) =>
      chat("Hello there!", "The cat sat. ".repeat(1 + (i % 6))),
    );
    const grouped = planSft(model, mixed, { batchSize: "auto", tokensPerStep: 200 }).prepared;
    let padded = 0;
    let real = 0;
    for (const step of grouped.plan) {
      const lens = step.examples.map((i) => grouped.sequences[i]!.tokens.length);
      padded += lens.length * Math.max(...lens);
      real += lens.reduce((a, b) => a + b, 0);
    }
    expect(real / padded).toBeGreaterThan(0.9);
    expect(planSft(model, examples, { batchSize: 2, epochs: 3 }).totalSteps).toBe(9);
  });

  it("when one pass runs in fixed batches, then batch i is lines i·B… in order; several passes shuffle", () => {
    const model = tinyModel(32);
    const once = planSft(model, examples, { batchSize: 2, epochs: 1 }).prepared.plan;
    expect(once.map((p) => p.examples)).toEqual([[0, 1], [2, 3], [4]]);
    const twice = planSft(model, examples, { batchSize: 2, epochs: 2 }).prepared.plan;
    expect(twice.flatMap((p) => p.examples)).not.toEqual([0, 1, 2, 3, 4, 0, 1, 2, 3, 4]);
  });

  it("when the learning rate is a list of another length than the batches, then nothing trains and the error names both", async () => {
    const model = tinyModel(32);
    await expect(
      trainSft(
        model,
        examples,
        { batchSize: 2, learningRate: [1e-3, 1e-3] },
        { kernels: jsKernels },
      ),
    ).rejects.toThrow(/2 values for 3 batches/);
  });

  it("when assistant_turns is last, then only the last assistant turn is trained", () => {
    const model = tinyModel(33, { maxPositions: 256 });
    const all = planSft(model, [examples[2]!], { assistantTurns: "all" }).prepared.sequences[0]!;
    const last = planSft(model, [examples[2]!], { assistantTurns: "last" }).prepared.sequences[0]!;
    const ids = (s: typeof all) =>
      model.tokenizer.decode(s.tokens.filter((_, i) => s.weights[i] === 1));
    expect(ids(all)).toBe("elppa<|im_end|>APPLE<|im_end|>");
    expect(ids(last)).toBe("APPLE<|im_end|>");
  });

  it("when an example has nothing to learn, then a TrainingInputError names it", () => {
    const model = tinyModel(34);
    const bad = [examples[0]!, { messages: [{ role: "user" as const, content: "no answer" }] }];
    expect(() => planSft(model, bad)).toThrow(TrainingInputError);
    expect(() => planSft(model, bad)).toThrow(/example 1: no assistant message/);
    expect(() => planSft(model, [])).toThrow(TrainingInputError);
  });

  it("when run twice with one seed, then adapters are bit-identical, metrics are complete, and a resumed run matches", async () => {
    const model = tinyModel(35);
    const config = {
      learningRate: [5e-3, 4e-3, 3e-3, 2e-3, 1e-3, 1e-3],
      batchSize: 2,
      epochs: 2,
      seed: 7,
      lora: { rank: 4, alpha: 8 },
    };
    const run = async (
      onStep?: (p: { step: number; adapter: LoraAdapter; state: Uint8Array }) => void,
    ) =>
      trainSft(model, examples, config, {
        kernels: jsKernels,
        onStep: async (p) =>
          onStep?.({ step: p.step, adapter: p.adapter, state: p.optimizerState() }),
      });
    let saved: { adapter: LoraAdapter; state: Uint8Array } | null = null;
    const a = await run((p) => {
      if (p.step === 2) saved = { adapter: cloneAdapter(p.adapter), state: p.state };
    });
    const b = await run();
    const bytes = (x: LoraAdapter) => adapterToFiles(x)["adapter_model.safetensors"];
    expect(bytes(a.adapter)).toEqual(bytes(b.adapter));
    expect(a.totalSteps).toBe(6);
    expect(a.steps.map((s) => s.learning_rate)).toEqual(config.learningRate);
    expect(a.steps.map((s) => s.gradient_step)).toEqual([1, 2, 3, 4, 5, 6]);
    expect(Object.keys(a.steps[0]!).sort()).toEqual(
      [
        "gradient_step",
        "grad_norm",
        "learning_rate",
        "loss",
        "mean_token_accuracy",
        "num_tokens",
        "num_trainable_tokens",
        "tokens_per_second",
      ].sort(),
    );
    for (const s of a.steps) {
      expect(s.num_trainable_tokens).toBeGreaterThan(0);
      expect(s.num_tokens).toBeGreaterThan(s.num_trainable_tokens);
      expect(Number.isFinite(s.loss) && s.grad_norm > 0).toBe(true);
    }
    const checkpoint = saved as { adapter: LoraAdapter; state: Uint8Array } | null;
    expect(checkpoint).not.toBeNull();
    const resumed = await trainSft(model, examples, config, {
      kernels: jsKernels,
      resume: { step: 2, adapter: checkpoint!.adapter, optimizerState: checkpoint!.state },
    });
    expect(resumed.steps.map((s) => s.gradient_step)).toEqual([3, 4, 5, 6]);
    expect(bytes(resumed.adapter)).toEqual(bytes(a.adapter));
  });

  it("when a step is split into micro-batches, then loss and update match one batch (global token mean)", async () => {
    const model = tinyModel(37);
    const config = { learningRate: 1e-2, batchSize: 5, seed: 2, lora: { rank: 2 } };
    const whole = await trainSft(
      model,
      examples,
      { ...config, microBatchTokens: 100_000 },
      {
        kernels: jsKernels,
      },
    );
    const split = await trainSft(
      model,
      examples,
      { ...config, microBatchTokens: 1 },
      {
        kernels: jsKernels,
      },
    );
    expect(split.steps[0]!.loss).toBeCloseTo(whole.steps[0]!.loss, 5);
    expect(split.steps[0]!.grad_norm).toBeCloseTo(whole.steps[0]!.grad_norm, 5);
    expect(split.steps[0]!.num_trainable_tokens).toBe(whole.steps[0]!.num_trainable_tokens);
  });

  it("when the signal is aborted during a step callback, then training stops before the next step", async () => {
    const model = tinyModel(36);
    const controller = new AbortController();
    let steps = 0;
    await expect(
      trainSft(
        model,
        examples,
        { batchSize: 1 },
        {
          kernels: jsKernels,
          signal: controller.signal,
          onStep: () => {
            steps++;
            if (steps === 2) controller.abort(new Error("cancelled"));
          },
        },
      ),
    ).rejects.toThrow("cancelled");
    expect(steps).toBe(2);
  });
});

describe("SFT on the shipped model", () => {
  it("when trained on the held-out JSON-answer task, then greedy exact-match accuracy on unseen prompts rises", async () => {
    const model = await loadModel(catalogModelDir("arbor/tiny-chat"));
    const rng = new Rng(1);
    const train = Array.from({ length: 320 }, () => {
      const [q, a] = jsonAnswerExample(rng);
      return chat(q, a);
    });
    const seen = new Set(train.map((e) => (e.messages[0] as { content: string }).content));
    const testRng = new Rng(99);
    const test: [string, string][] = [];
    while (test.length < 30) {
      const example = jsonAnswerExample(testRng);
      if (!seen.has(example[0])) test.push(example);
    }
    const engine = new Engine(model);
    const score = async (adapter: LoraAdapter | null) => {
      const outs = await Promise.all(
        test.map(([q]) =>
          engine.complete({
            messages: [{ role: "user", content: q }],
            temperature: 0,
            maxTokens: 16,
            adapter,
          }),
        ),
      );
      const texts = outs.map((c) => c.choices[0]!.text.trim());
      return {
        exact: texts.filter((t, i) => t === test[i]![1]).length / test.length,
        format: texts.filter((t) => /^\{"answer": ?\d+\}$/.test(t)).length / test.length,
      };
    };
    const before = await score(null);
    const result = await trainSft(model, train, {
      learningRate: 3e-3,
      schedule: "cosine",
      batchSize: 8,
      epochs: 10,
      seed: 1,
      lora: { rank: 8, alpha: 16 },
    });
    const after = await score(result.adapter);
    console.log(
      `SFT learning: exact ${before.exact} → ${after.exact}, format ${before.format} → ${after.format}`,
    );
    expect(before.exact).toBeLessThanOrEqual(0.1);
    expect(before.format).toBeLessThanOrEqual(0.1);
    expect(after.format).toBeGreaterThanOrEqual(0.9);
    expect(after.exact).toBeGreaterThanOrEqual(0.5);
  });
});
