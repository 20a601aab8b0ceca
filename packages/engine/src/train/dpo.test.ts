import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { afterAll, describe, expect, it } from "vitest";
import { tinyModel } from "../../test/fixtures.ts";
import { jsKernels } from "../kernels/js.ts";
import type { Kernels } from "../kernels/types.ts";
import { createWasmKernels } from "../kernels/wasm.ts";
import {
  adapterToFiles,
  cloneAdapter,
  createLoraAdapter,
  type LoraAdapter,
  loraParameters,
  saveAdapter,
} from "../model/lora.ts";
import { type Model, saveModel } from "../model/model.ts";
import { Rng } from "../model/rng.ts";
import {
  type DpoPair,
  type DpoStepMetrics,
  dpoBackward,
  type PreparedPair,
  planDpo,
  trainDpo,
} from "./dpo.ts";
import { LoraTrainer } from "./lora-train.ts";
import { packBatch } from "./sft.ts";
import { TrainingInputError } from "./training-data.ts";

/**
 * DPO (ADR 69) against a PyTorch reference of its loss and gradients (test/torch_reference.py,
 * Debian's python3-torch), and as training: the margin grows, the reference stays frozen.
 */
const torchFound = spawnSync("/usr/bin/python3", ["-c", "import torch"]).status === 0;
const required = process.env.CI === "true";
if (!torchFound) {
  console.log(
    `dpo.test: PyTorch not found (/usr/bin/python3 -c "import torch"): ${required ? "failing, as CI needs it" : "its reference test skipped"}; apt-get install python3-torch libopenblas0-pthread`,
  );
}

const dirs: string[] = [];
afterAll(() => {
  for (const dir of dirs) rmSync(dir, { recursive: true, force: true });
});

const user = (content: string) => ({ role: "user" as const, content });
const assistant = (content: string) => ({ role: "assistant" as const, content });

const pairs: DpoPair[] = [
  {
    messages: [user("Hello there!")],
    chosen: assistant("The cat sat."),
    rejected: assistant("The dog"),
  },
  {
    messages: [{ role: "system", content: "Be short." }, user("What is 7 + 5?")],
    chosen: assistant("7 + 5 = 12."),
    rejected: assistant("7 + 5 = 13, I think, or maybe 11."),
  },
  {
    messages: [user("Reverse apple"), assistant("elppa"), user("Uppercase")],
    chosen: assistant("APPLE"),
    rejected: assistant("apple"),
  },
  {
    messages: [user("JSON")],
    chosen: assistant('{"name": "Ada"}'),
    rejected: assistant("name Ada"),
  },
];

/** A LoRA adapter on every linear and the head, A and B random (so it changes the output). */
function randomAdapter(model: Model, seed: number): LoraAdapter {
  const adapter = createLoraAdapter(model, { rank: 4, alpha: 8, head: true }, seed);
  const rng = new Rng(seed + 100);
  for (const p of loraParameters(adapter))
    for (let i = 0; i < p.data.length; i++) p.data[i] = 0.1 * rng.normal();
  return adapter;
}

/** A sequence as the reference reads it: position t predicts token t + 1 with its weight. */
const wire = (row: PreparedPair["chosen"]) => ({
  inputs: row.tokens.slice(0, -1),
  targets: row.tokens.slice(1),
  mask: Array.from(row.weights).slice(1),
});

interface TorchDpo {
  loss: number;
  grads: Record<string, number[]>;
  chosen_rewards: number[];
  rejected_rewards: number[];
}

function torchDpo(dir: string, request: object): TorchDpo {
  const script = fileURLToPath(new URL("../../test/torch_reference.py", import.meta.url));
  const result = spawnSync("/usr/bin/python3", [script, dir], {
    input: JSON.stringify({ prompts: [], dpo: request }),
    encoding: "utf8",
    maxBuffer: 256 * 1024 * 1024,
    env: { ...process.env, TORCH_THREADS: "1", OMP_NUM_THREADS: "1" },
  });
  if (result.status !== 0) throw new Error(`torch_reference.py failed: ${result.stderr}`);
  return (JSON.parse(result.stdout) as { dpo: TorchDpo }).dpo;
}

function maxAbsDiff(a: ArrayLike<number>, b: ArrayLike<number>): number {
  let max = 0;
  for (let i = 0; i < a.length; i++) max = Math.max(max, Math.abs(a[i]! - b[i]!));
  return max;
}

/** Masked log-prob sum of each row under `adapter` (null: the base alone), forward only. */
function sequenceLogprobs(
  model: Model,
  rows: readonly PreparedPair["chosen"][],
  adapter: LoraAdapter | null,
): number[] {
  const trainer = new LoraTrainer(model, createLoraAdapter(model, { rank: 1 }), {
    kernels: jsKernels,
  });
  return rows.map((row) => {
    const batch = packBatch([row], model.config.maxPositions);
    const logprobs = trainer.referenceLogprobs(batch, adapter);
    let sum = 0;
    for (let r = 0; r < logprobs.length; r++) sum += batch.lossMask[r]! * logprobs[r]!;
    return sum;
  });
}

describe("dpoBackward", () => {
  it.skipIf(!torchFound && !required).each([
    { name: "the base as reference, β 0.1", beta: 0.1, withReference: false },
    { name: "an adapter as reference, β 1", beta: 1, withReference: true },
  ])(
    "when the loss and LoRA gradients of $name are computed in one micro-batch or one pair at a time, then they match PyTorch's within 1e-4",
    async ({ beta, withReference }) => {
      const dir = mkdtempSync(join(tmpdir(), "arbor-dpo-"));
      dirs.push(dir);
      const model = tinyModel(5);
      await saveModel(model, dir, { dtype: "F32" });
      const policy = randomAdapter(model, 3);
      await saveAdapter(policy, join(dir, "policy"));
      const reference = withReference ? randomAdapter(model, 9) : null;
      if (reference) await saveAdapter(reference, join(dir, "reference"));
      const { prepared } = planDpo(model, pairs, { beta });
      const torch = torchDpo(dir, {
        lora: join(dir, "policy"),
        reference: reference ? join(dir, "reference") : null,
        beta,
        pairs: prepared.pairs.map((p) => ({ chosen: wire(p.chosen), rejected: wire(p.rejected) })),
      });

      const kernelSets: [string, Kernels][] = [
        ["wasm", createWasmKernels("auto", { threads: 1 })],
        ["js", jsKernels],
      ];
      for (const [kernelName, kernels] of kernelSets) {
        for (const tokens of [4096, 1]) {
          const label = `${kernelName}, micro-batches of ${tokens === 1 ? "one pair" : "all pairs"}`;
          const trainer = new LoraTrainer(model, cloneAdapter(policy), { kernels });
          const result = dpoBackward(trainer, prepared.pairs, beta, reference, {
            tokens,
            recompute: false,
          });
          // Absolute on the loss and the rewards; on each gradient tensor relative to its
          // largest entry (the gradients' scale is β·σ/n, small for β 0.1).
          expect(Math.abs(result.loss - torch.loss), label).toBeLessThanOrEqual(1e-4);
          expect(maxAbsDiff(result.chosenRewards, torch.chosen_rewards), label).toBeLessThan(1e-4);
          expect(maxAbsDiff(result.rejectedRewards, torch.rejected_rewards), label).toBeLessThan(
            1e-4,
          );
          for (const p of loraParameters(trainer.grads)) {
            const expected = torch.grads[p.name]!;
            expect(expected, p.name).toHaveLength(p.data.length);
            const scale = Math.max(...expected.map(Math.abs));
            expect(scale, p.name).toBeGreaterThan(0);
            expect(maxAbsDiff(p.data, expected) / scale, `${label}: ${p.name}`).toBeLessThan(1e-4);
          }
        }
      }
    },
  );
});

describe("trainDpo", () => {
  const preferences: DpoPair[] = [
    ["Hello there!", "The cat sat.", "The dog"],
    ["What is 7 + 5?", "7 + 5 = 12.", "7 + 5 = 13."],
    ["Reverse apple", "elppa", "apple"],
    ["The dog", "sat on the log.", "sat on the mat."],
    ["JSON", '{"name": "Ada"}', '{"age": 36}'],
    ["Uppercase apple", "APPLE", "Apple"],
  ].map(([q, c, r]) => ({ messages: [user(q!)], chosen: assistant(c!), rejected: assistant(r!) }));

  it("when trained for a few steps, then the chosen-minus-rejected margin grows, and the metrics say so", async () => {
    const model = tinyModel(7);
    const { prepared } = planDpo(model, preferences);
    const rows = prepared.pairs.flatMap((p) => [p.chosen, p.rejected]);
    const margins = (adapter: LoraAdapter | null) => {
      const lp = sequenceLogprobs(model, rows, adapter);
      return prepared.pairs.map((_, k) => lp[2 * k]! - lp[2 * k + 1]!);
    };
    const before = margins(null);
    const steps: DpoStepMetrics[] = [];
    const { adapter } = await trainDpo(
      model,
      preferences,
      { learningRate: 1e-2, schedule: "constant", batchSize: 3, epochs: 4, seed: 2 },
      { kernels: jsKernels, onStep: ({ metrics }) => void steps.push(metrics) },
    );
    const after = margins(adapter);
    expect(steps).toHaveLength(8);
    for (let k = 0; k < preferences.length; k++)
      expect(after[k]!, `pair ${k}`).toBeGreaterThan(before[k]!);
    const first = steps[0]!;
    const last = steps.at(-1)!;
    // A fresh adapter is the base: no reward, and the loss log 2.
    expect(first).toMatchObject({ reward_chosen: 0, reward_rejected: 0, reward_margin: 0 });
    expect(first.loss).toBeCloseTo(Math.log(2), 6);
    expect(last.reward_margin).toBeGreaterThan(0.5);
    expect(last.reward_accuracy).toBe(1);
    expect(last.loss).toBeLessThan(first.loss - 0.2);
    for (const m of steps) {
      expect(m.num_trainable_tokens).toBeGreaterThan(0);
      expect(m.num_tokens).toBeGreaterThan(m.num_trainable_tokens);
      expect(m.learning_rate).toBe(1e-2);
      expect(m.reward_margin).toBeCloseTo(m.reward_chosen - m.reward_rejected, 12);
    }
  });

  /** Each step's rewards, recomputed from the adapter before it against `reference`. */
  async function expectRewardsAgainst(
    model: Model,
    start: LoraAdapter | undefined,
    reference: LoraAdapter | null | undefined,
    frozen: LoraAdapter | null,
  ): Promise<void> {
    const beta = 0.5;
    const config = { beta, learningRate: 2e-2, batchSize: 6, epochs: 3, seed: 1 };
    const { prepared } = planDpo(model, preferences, config);
    const rows = prepared.pairs.flatMap((p) => [p.chosen, p.rejected]);
    const ref = sequenceLogprobs(model, rows, frozen);
    let previous = start ? cloneAdapter(start) : null;
    const seen: number[][] = [];
    const expected: number[][] = [];
    await trainDpo(model, preferences, config, {
      kernels: jsKernels,
      ...(start ? { adapter: start } : {}),
      ...(reference !== undefined ? { reference } : {}),
      onStep: ({ metrics, adapter }) => {
        const policy = sequenceLogprobs(model, rows, previous);
        const rewards = rows.map((_, i) => beta * (policy[i]! - ref[i]!));
        expected.push([
          rewards.filter((_, i) => i % 2 === 0).reduce((a, b) => a + b) / preferences.length,
          rewards.filter((_, i) => i % 2 === 1).reduce((a, b) => a + b) / preferences.length,
        ]);
        seen.push([metrics.reward_chosen, metrics.reward_rejected]);
        previous = cloneAdapter(adapter);
      },
    });
    expect(seen).toHaveLength(3);
    for (let s = 0; s < 3; s++) {
      expect(Math.abs(seen[s]![0]! - expected[s]![0]!), `step ${s + 1}`).toBeLessThan(1e-5);
      expect(Math.abs(seen[s]![1]! - expected[s]![1]!), `step ${s + 1}`).toBeLessThan(1e-5);
    }
    // The policy moved away from the reference.
    expect(Math.abs(seen[2]![0]!)).toBeGreaterThan(1e-3);
  }

  it("when a fresh adapter trains, then the reference of every step is the frozen base", async () => {
    await expectRewardsAgainst(tinyModel(8), undefined, undefined, null);
  });

  it("when training starts from an adapter, then the reference is that starting adapter, frozen, unless another is given", async () => {
    const model = tinyModel(8);
    const start = randomAdapter(model, 4);
    await expectRewardsAgainst(model, cloneAdapter(start), undefined, start);
    await expectRewardsAgainst(model, cloneAdapter(start), null, null);
  });

  it("when a run is resumed from a step with its reference, then it ends as the unbroken run does", async () => {
    const model = tinyModel(9);
    const start = randomAdapter(model, 6);
    const config = { learningRate: 1e-2, batchSize: 2, epochs: 2, seed: 3 };
    const unbroken = await trainDpo(model, preferences, config, {
      kernels: jsKernels,
      adapter: cloneAdapter(start),
    });
    let saved: { step: number; adapter: LoraAdapter; optimizerState: Uint8Array } | undefined;
    await trainDpo(model, preferences, config, {
      kernels: jsKernels,
      adapter: cloneAdapter(start),
      onStep: (p) => {
        if (p.step === 2)
          saved = { step: 2, adapter: cloneAdapter(p.adapter), optimizerState: p.optimizerState() };
        if (p.step === 2) throw new Error("crash");
      },
    }).catch(() => undefined);
    const resumed = await trainDpo(model, preferences, config, {
      kernels: jsKernels,
      resume: saved!,
      reference: start,
    });
    expect(resumed.steps.map((s) => s.gradient_step)).toEqual([3, 4, 5, 6]);
    expect(resumed.steps).toEqual(
      unbroken.steps.slice(2).map((s) => ({ ...s, tokens_per_second: expect.any(Number) })),
    );
    expect(adapterToFiles(resumed.adapter)["adapter_model.safetensors"]).toEqual(
      adapterToFiles(unbroken.adapter)["adapter_model.safetensors"],
    );
  });

  it("when a pair is unusable, then a TrainingInputError names it", () => {
    const model = tinyModel(10);
    expect(() => planDpo(model, [])).toThrow(/dpo: no preference pairs/);
    expect(() => planDpo(model, preferences, { beta: 0 })).toThrow(TrainingInputError);
    const bad = { ...preferences[1]!, rejected: user("no") };
    expect(() => planDpo(model, [preferences[0]!, bad])).toThrow(
      /pair 1: the non-preferred output must be an assistant message/,
    );
    const long = { ...preferences[0]!, messages: [user("The cat sat on the mat. ".repeat(40))] };
    expect(() => planDpo(model, [long])).toThrow(
      /pair 0: the prompt takes the whole 64-token limit/,
    );
  });
});
