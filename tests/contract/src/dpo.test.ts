import type { ArborClient, DpoExample, GradientStepEvent } from "@arbor/client";
import {
  adapterFromFiles,
  catalogModelDir,
  createLoraAdapter,
  type LoraAdapter,
  loadModel,
  type Model,
} from "@arbor/engine/model";
import { LoraTrainer, planDpo } from "@arbor/engine/train";
import { readAdapterTar } from "@arbor/training";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { followAll, reversal } from "./jobs.ts";

/**
 * DPO through the SFT jobs API (`config.method: "dpo"`, ADR 69) on the shipped model: a job on
 * preference pairs steps with DPO's metrics, and its checkpoint prefers the preferred answers
 * more than the base did, measured by the engine on the downloaded adapter.
 */
const BASE = "arbor/tiny-chat";
let server: RunningServer;
let client: ArborClient;
let base: Model;
beforeAll(async () => {
  server = await startServer({}, { worker: true });
  client = server.authorizedClient();
  base = await loadModel(catalogModelDir(BASE));
});
afterAll(() => server.close());

const words = ["cat", "dog", "sun", "map", "pen", "cup", "hat", "box"];

/** Prefer the reversed word to the word as it is. */
const pairOf = (word: string): DpoExample => ({
  input: { messages: [{ role: "user", content: `Reverse the word ${word}.` }] },
  preferred_output: [{ role: "assistant", content: [...word].reverse().join("") }],
  non_preferred_output: [{ role: "assistant", content: word }],
});

async function newModel(name: string): Promise<string> {
  return (await client.training.models.create({ project: "dpo", name, base_model: BASE })).id;
}

async function stepsOf(jobId: string) {
  const events = await followAll(client, jobId);
  expect(events.at(-1)?.type, JSON.stringify(events.at(-1)?.data)).toBe("training_ended");
  return events
    .filter((e): e is GradientStepEvent => e.type === "gradient_step")
    .map((e) => e.data);
}

/** Each pair's log-prob margin, preferred minus non-preferred, under `adapter` (null: the base). */
function margins(pairs: readonly DpoExample[], adapter: LoraAdapter | null): number[] {
  const { prepared } = planDpo(
    base,
    pairs.map((p) => ({
      messages: p.input.messages.map((m) => ({ role: m.role, content: String(m.content) })),
      chosen: { role: "assistant", content: String(p.preferred_output[0]!.content) },
      rejected: { role: "assistant", content: String(p.non_preferred_output[0]!.content) },
    })),
  );
  // The trainer's own adapter is not used: `referenceLogprobs` runs `adapter` (or the base).
  const trainer = new LoraTrainer(base, createLoraAdapter(base, { rank: 1 }));
  const logprob = (row: (typeof prepared.pairs)[number]["chosen"]) => {
    const batch = {
      batchSize: 1,
      seqLen: row.tokens.length - 1,
      inputs: Int32Array.from(row.tokens.slice(0, -1)),
      targets: Int32Array.from(row.tokens.slice(1)),
      lossMask: Float32Array.from(Array.from(row.weights).slice(1)),
    };
    const lp = trainer.referenceLogprobs(batch, adapter);
    return lp.reduce((sum, v, i) => sum + batch.lossMask[i]! * v, 0);
  };
  return prepared.pairs.map((p) => logprob(p.chosen) - logprob(p.rejected));
}

async function checkpointAdapter(modelId: string, step: number): Promise<LoraAdapter> {
  const { body } = await client.training.models.checkpoints.download(modelId, step);
  const tar = new Uint8Array(await new Response(body).arrayBuffer());
  return adapterFromFiles(await readAdapterTar(tar), base);
}

describe("createSftTrainingJob with config.method dpo", () => {
  it("when a DPO job runs on preference pairs, then its steps report DPO's rewards, and its checkpoint prefers the preferred answers more than the base did", async () => {
    const modelId = await newModel("dpo-reverser");
    const pairs = words.map(pairOf);
    const dataset = await client.training.datasets.create(pairs);
    expect(dataset.lines).toBe(8);
    const listed = await client.training.datasets.lines(dataset.id, { limit: 2 });
    expect(listed.data.map((l) => l.example)).toEqual(pairs.slice(0, 2));

    const job = await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: dataset.url,
      config: { method: "dpo", dpo_beta: 0.1, epochs: 3, batch_size: 4, checkpoint_every: 3 },
    });
    expect(job).toMatchObject({ type: "sft", status: "queued", step_from: 0 });
    const steps = await stepsOf(job.id);
    expect(steps.map((s) => s.gradient_step)).toEqual([1, 2, 3, 4, 5, 6]);
    for (const step of steps) {
      for (const key of [
        "loss",
        "grad_norm",
        "learning_rate",
        "num_tokens",
        "num_trainable_tokens",
        "tokens_per_second",
        "reward_chosen",
        "reward_rejected",
        "reward_accuracy",
        "reward_margin",
      ] as const)
        expect(typeof step[key], key).toBe("number");
      expect(step.reward_margin!).toBeCloseTo(step.reward_chosen! - step.reward_rejected!, 9);
    }
    // A fresh adapter is the base, the reference: no reward yet, and the loss is log 2.
    expect(steps[0]).toMatchObject({ reward_chosen: 0, reward_rejected: 0, reward_margin: 0 });
    expect(steps[0]!.loss).toBeCloseTo(Math.log(2), 6);
    expect(steps.at(-1)!.reward_margin!).toBeGreaterThan(0);
    expect(steps.at(-1)!.reward_accuracy).toBe(1);
    expect(steps.at(-1)!.loss).toBeLessThan(steps[0]!.loss!);

    const done = await client.training.jobs.retrieve(job.id);
    expect(done).toMatchObject({ status: "succeeded", step_to: 6, error_message: null });
    const { data: checkpoints } = await client.training.models.checkpoints.list(modelId, {
      order: "asc",
    });
    expect(checkpoints.map((c) => c.step)).toEqual([0, 3, 6]);
    expect(Object.keys(checkpoints.at(-1)!.metrics)).toEqual(
      expect.arrayContaining(["train/loss", "train/reward_margin", "train/reward_accuracy"]),
    );

    const before = margins(pairs, null);
    const after = margins(pairs, await checkpointAdapter(modelId, 6));
    const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
    expect(mean(after)).toBeGreaterThan(mean(before) + 1);
    expect(after.filter((m, i) => m > before[i]!).length).toBeGreaterThanOrEqual(6);
  });

  it("when a DPO job continues from an SFT checkpoint, then that checkpoint is its reference: its first step has no reward", async () => {
    const modelId = await newModel("sft-then-dpo");
    const sft = await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: (await client.training.datasets.create(words.map(reversal))).url,
      config: { epochs: 1, batch_size: 4 },
    });
    await stepsOf(sft.id);
    const dpo = await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: (await client.training.datasets.create(words.map(pairOf))).url,
      config: { method: "dpo", epochs: 2, batch_size: 4 },
    });
    expect(dpo.step_from).toBe(2);
    const steps = await stepsOf(dpo.id);
    expect(steps).toHaveLength(4);
    // Against the base, the SFT checkpoint already prefers the reversals: a reward at once.
    expect(steps[0]).toMatchObject({ reward_chosen: 0, reward_rejected: 0, reward_margin: 0 });
    expect(steps.at(-1)!.reward_margin!).toBeGreaterThan(0);
    expect((await client.training.jobs.retrieve(dpo.id)).step_to).toBe(6);
  });

  it("when dpo_beta is given without method dpo, then 400 invalid_config and nothing is queued", async () => {
    const modelId = await newModel("beta-without-dpo");
    const url = (await client.training.datasets.create(words.map(reversal))).url;
    const { response, error } = await client.POST("/v1/preview/sft-training-jobs", {
      body: { model_id: modelId, training_data_url: url, config: { dpo_beta: 0.2 } },
    });
    expect(response.status).toBe(400);
    expect((error as { error: { code: string; param: string } }).error).toMatchObject({
      code: "invalid_config",
      param: "config.dpo_beta",
    });
    expect((await server.store.jobs.list("default", { model_id: modelId })).data).toEqual([]);
  });

  it.each([
    ["dpo", "an SFT dataset", () => words.map(reversal), /holds SFT examples/],
    ["sft", "a DPO dataset", () => words.map(pairOf), /holds DPO preference pairs/],
  ] as const)(
    "when method %s is asked of %s, then 400 dataset_method_mismatch and nothing is queued",
    async (method, _, lines, message) => {
      const modelId = await newModel(`mismatch-${method}`);
      const url = (await client.training.datasets.create(lines())).url;
      const { response, error } = await client.POST("/v1/preview/sft-training-jobs", {
        body: { model_id: modelId, training_data_url: url, config: { method } },
      });
      expect(response.status).toBe(400);
      const body = (error as { error: { code: string; param: string; message: string } }).error;
      expect(body).toMatchObject({ code: "dataset_method_mismatch", param: "config.method" });
      expect(body.message).toMatch(message);
      expect((await server.store.jobs.list("default", { model_id: modelId })).data).toEqual([]);
    },
  );

  it("when an upload mixes SFT examples and DPO pairs, then 400 names the first line of the other kind", async () => {
    const { response, error } = await client.POST("/v1/preview/datasets", {
      body: [pairOf("cat"), pairOf("dog"), reversal("sun")]
        .map((l) => JSON.stringify(l))
        .join("\n"),
      bodySerializer: (b: unknown) => b as string,
      headers: { "content-type": "application/jsonl" },
    });
    expect(response.status).toBe(400);
    expect((error as { error: { code: string; message: string } }).error).toMatchObject({
      code: "invalid_dataset",
      message:
        "Line 3: this line is an SFT example ({messages}) and the dataset's first line a DPO pair ({input, preferred_output, non_preferred_output}): a dataset holds one kind.",
    });
  });
});
