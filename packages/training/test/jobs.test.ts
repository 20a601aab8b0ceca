import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type Model, openStore, type Store } from "@arbor/store";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createDataset } from "../src/datasets/datasets.ts";
import {
  checkRlSpec,
  enqueueRlJob,
  enqueueSftJob,
  MAX_JOB_EXAMPLES,
  MAX_VALIDATION_EXAMPLES,
  PAYLOADS_PREFIX,
  rlJobSpec,
  rlStepConfig,
  sftJobSpec,
  sftTrainingConfig,
  validationSteps,
} from "../src/jobs.ts";

/** The training domain's jobs, without HTTP: what is checked at enqueue, what is stored, and
 * how a stored spec becomes the engine's configuration. */
let dataDir: string;
let store: Store;
let model: Model;
beforeAll(async () => {
  dataDir = mkdtempSync(join(tmpdir(), "arbor-jobs-"));
  store = await openStore({ dataDir });
  await store.entities.ensure("e");
  ({ model } = await store.models.create({
    entity: "e",
    project: "p",
    name: "m",
    base_model: "arbor/tiny-chat",
    initialCheckpoint: { step: 0, blob_key: null },
  }));
});
afterAll(async () => {
  await store.close();
  rmSync(dataDir, { recursive: true, force: true });
});

const line = JSON.stringify({
  messages: [
    { role: "user", content: "Hi" },
    { role: "assistant", content: "Hello" },
  ],
});

describe("sftTrainingConfig", () => {
  it("when the spec is empty, then the engine gets the documented defaults", () => {
    expect(sftTrainingConfig({ config: {}, experimental_config: {} }, "arbor/tiny-chat")).toEqual({
      seed: 0,
      lora: { baseModel: "arbor/tiny-chat" },
      epochs: 1,
      batchSize: "auto",
      assistantTurns: "all",
      schedule: "cosine",
      warmupSteps: 0,
    });
  });

  it("when no learning rate is set, then it is chosen by the base model's size", () => {
    const empty = { config: {}, experimental_config: {} };
    expect(sftTrainingConfig(empty, "arbor/tiny-chat", 840_000).learningRate).toBe(3e-3);
    expect(sftTrainingConfig(empty, "qwen/Qwen3-0.6B", 600_000_000).learningRate).toBe(2e-4);
    expect(
      sftTrainingConfig({ config: { learning_rate: 1e-4 }, experimental_config: {} }, "x", 1000)
        .learningRate,
    ).toBe(1e-4);
  });

  it("when fields are set, then each reaches its engine setting, and null means the default", () => {
    const config = sftTrainingConfig(
      {
        config: {
          epochs: 3,
          batch_size: 8,
          learning_rate: [1e-3, 5e-4],
          lr_schedule: "cosine",
          warmup_steps: 2,
          assistant_turns: "last",
        },
        experimental_config: {
          lora_rank: 4,
          lora_alpha: null,
          max_seq_len: 256,
          max_grad_norm: 0.5,
          weight_decay: 0.01,
          seed: 7,
        },
      },
      "base",
    );
    expect(config).toEqual({
      seed: 7,
      lora: { baseModel: "base", rank: 4 },
      epochs: 3,
      batchSize: 8,
      assistantTurns: "last",
      schedule: "cosine",
      warmupSteps: 2,
      learningRate: [1e-3, 5e-4],
      maxLength: 256,
      maxGradNorm: 0.5,
      adamW: { weightDecay: 0.01 },
    });
  });
});

describe("validationSteps", () => {
  it("when eval_every is absent, then checkpoint_every, else a tenth of the steps; always 0 and the last", () => {
    const sorted = (s: Set<number>) => [...s].sort((a, b) => a - b);
    expect(sorted(validationSteps({}, 25))).toEqual([0, 3, 6, 9, 12, 15, 18, 21, 24, 25]);
    expect(sorted(validationSteps({ checkpoint_every: 10 }, 25))).toEqual([0, 10, 20, 25]);
    expect(sorted(validationSteps({ checkpoint_every: 10, eval_every: 7 }, 25))).toEqual([
      0, 7, 14, 21, 25,
    ]);
    expect(sorted(validationSteps({}, 1))).toEqual([0, 1]);
  });
});

describe("rlStepConfig", () => {
  it("when fields are null or absent, then the defaults hold; set ones reach the engine", () => {
    expect(rlStepConfig({ learning_rate: null, loss_fn: null }, 4)).toEqual({
      config: { lossFn: "cispo", scaleRewards: true },
      learningRate: 1e-5,
      maxGradNorm: 1,
      seed: 0,
      klReferenceStep: null,
    });
    expect(
      rlStepConfig(
        {
          learning_rate: 3e-4,
          loss_fn: "cispo",
          epsilon: 0.1,
          epsilon_high: 0.3,
          scale_rewards: true,
          normalize_advantages: false,
          importance_sampling_level: "sequence",
          max_negative_advantage_importance_sampling_weight: 5,
          allow_training_without_logprobs: false,
          kl_penalty_coef: 0.1,
          kl_penalty_step_lag: 3,
          max_grad_norm: 2,
          seed: 5,
        },
        4,
      ),
    ).toEqual({
      config: {
        lossFn: "cispo",
        epsilon: 0.1,
        epsilonHigh: 0.3,
        scaleRewards: false,
        importanceSamplingLevel: "sequence",
        maxImportanceWeight: 5,
        allowTrainingWithoutLogprobs: false,
        klPenaltyCoef: 0.1,
      },
      learningRate: 3e-4,
      maxGradNorm: 2,
      seed: 5,
      klReferenceStep: 1,
    });
  });

  it("when only ART's ppo switch names the loss, then true is ppo and false cispo; a lag past the start is the base model", () => {
    expect(rlStepConfig({ ppo: true }, 0).config.lossFn).toBe("ppo");
    expect(rlStepConfig({ ppo: false }, 0).config.lossFn).toBe("cispo");
    expect(rlStepConfig({ kl_penalty_coef: 1, kl_penalty_step_lag: 9 }, 4).klReferenceStep).toBe(
      null,
    );
  });
});

describe("checkRlSpec", () => {
  it.each([
    [{ ppo: true, loss_fn: "cispo" as const }, "experimental_config.ppo"],
    [{ kl_ref_adapter_path: "/home/me/adapter" }, "experimental_config.kl_ref_adapter_path"],
    [
      { kl_penalty_reference_step: 2, kl_penalty_step_lag: 1 },
      "experimental_config.kl_penalty_step_lag",
    ],
  ])("when the settings cannot mean anything (%j), then 400 naming %s", (spec, param) => {
    expect(() => checkRlSpec(spec)).toThrow(expect.objectContaining({ param }));
  });

  it("when ART's defaults are sent, then they pass", () => {
    expect(() =>
      checkRlSpec({ ppo: false, loss_fn: "cispo", kl_ref_adapter_path: null }),
    ).not.toThrow();
  });
});

describe("enqueueSftJob", () => {
  it("when the data is one of the entity's datasets, then the job is queued with its spec as sent", async () => {
    const dataset = await createDataset(store, { entity: "e", name: null, text: `${line}\n` });
    const job = await enqueueSftJob(store, model, {
      training_data_url: `dataset://${dataset.id}`,
      config: { epochs: 2, batch_size: "auto" },
      experimental_config: null,
    });
    expect(job).toMatchObject({
      type: "sft",
      status: "queued",
      payload_ref: `dataset://${dataset.id}`,
    });
    expect(sftJobSpec(job)).toEqual({
      config: { epochs: 2, batch_size: "auto" },
      experimental_config: {},
    });
  });

  it("when the dataset is unknown or the URL is not one, then nothing is queued", async () => {
    const before = (await store.jobs.list("e", { limit: 100 })).data.length;
    await expect(
      enqueueSftJob(store, model, { training_data_url: "dataset://nope" }),
    ).rejects.toMatchObject({ kind: "not_found", code: "dataset_not_found" });
    await expect(
      enqueueSftJob(store, model, { training_data_url: "https://" }),
    ).rejects.toMatchObject({ kind: "invalid", param: "training_data_url" });
    expect((await store.jobs.list("e", { limit: 100 })).data.length).toBe(before);
  });

  it("when a validation set is given, then its URL is checked as the training data's and kept with the spec", async () => {
    const dataset = await createDataset(store, { entity: "e", name: null, text: `${line}\n` });
    const url = `dataset://${dataset.id}`;
    const job = await enqueueSftJob(store, model, {
      training_data_url: url,
      validation_data_url: url,
    });
    expect(sftJobSpec(job)).toEqual({
      config: {},
      experimental_config: {},
      validation_data_url: url,
    });
    await store.jobs.cancelJob("e", job.id);
    const before = (await store.jobs.list("e", { limit: 100 })).data.length;
    await expect(
      enqueueSftJob(store, model, {
        training_data_url: url,
        validation_data_url: "wandb-artifact:///e/p/data:v0",
      }),
    ).rejects.toMatchObject({
      kind: "invalid",
      code: "unsupported_validation_data_url",
      param: "validation_data_url",
      message: expect.stringContaining("dataset://"),
    });
    await expect(
      enqueueSftJob(store, model, {
        training_data_url: url,
        validation_data_url: "dataset://nope",
      }),
    ).rejects.toMatchObject({ kind: "not_found", code: "dataset_not_found" });
    await expect(
      enqueueSftJob(store, model, { training_data_url: url, validation_data_url: "https://" }),
    ).rejects.toMatchObject({ kind: "invalid", code: "invalid_validation_data_url" });
    expect((await store.jobs.list("e", { limit: 100 })).data.length).toBe(before);
  });

  it("when the validation dataset has more lines than a validation set may, then it is refused naming the limit", async () => {
    const train = await createDataset(store, { entity: "e", name: null, text: `${line}\n` });
    // Only the row's count is read at create.
    const big = await store.datasets.create({
      entity: "e",
      blob_key: "datasets/big-validation.jsonl",
      bytes: 1,
      lines: MAX_VALIDATION_EXAMPLES + 1,
    });
    await expect(
      enqueueSftJob(store, model, {
        training_data_url: `dataset://${train.id}`,
        validation_data_url: `dataset://${big.id}`,
      }),
    ).rejects.toMatchObject({
      kind: "invalid",
      code: "validation_set_too_large",
      param: "validation_data_url",
      message: expect.stringContaining(`limit of ${MAX_VALIDATION_EXAMPLES}`),
    });
  });

  it("when the dataset times the epochs is over the bound, then it is refused naming the limit", async () => {
    const dataset = await createDataset(store, {
      entity: "e",
      name: null,
      text: `${line}\n`.repeat(20),
    });
    await expect(
      enqueueSftJob(store, model, {
        training_data_url: `dataset://${dataset.id}`,
        config: { epochs: MAX_JOB_EXAMPLES / 10 },
      }),
    ).rejects.toMatchObject({
      kind: "invalid",
      code: "job_too_large",
      param: "config.epochs",
      message: expect.stringContaining(`limit of ${MAX_JOB_EXAMPLES}`),
    });
  });
});

describe("enqueueRlJob", () => {
  const choice = {
    index: 0,
    message: { role: "assistant" as const, content: "A" },
    finish_reason: "stop",
  };

  it("when the groups are valid, then they are stored as a blob the row points at", async () => {
    const groups = [
      {
        trajectories: [
          { messages_and_choices: [{ role: "user" as const, content: "Q" }, choice], reward: 1 },
          { messages_and_choices: [{ role: "user" as const, content: "Q" }, choice], reward: 0 },
        ],
      },
    ];
    const job = await enqueueRlJob(store, model, {
      trajectory_groups: groups,
      experimental_config: { learning_rate: 1e-4 },
    });
    expect(job.payload_ref?.startsWith(PAYLOADS_PREFIX)).toBe(true);
    expect(JSON.parse((await store.blobs.get(job.payload_ref!))!.toString())).toEqual(groups);
    expect(rlJobSpec(job)).toEqual({ learning_rate: 1e-4 });
  });

  it("when a trajectory has no sampled choice, then it is refused naming it, and no blob is left", async () => {
    const before = await store.blobs.list(PAYLOADS_PREFIX);
    await expect(
      enqueueRlJob(store, model, {
        trajectory_groups: [
          { trajectories: [{ messages_and_choices: [{ role: "user", content: "Q" }], reward: 1 }] },
        ],
      }),
    ).rejects.toMatchObject({
      kind: "invalid",
      code: "invalid_trajectory",
      param: "trajectory_groups[0].trajectories[0].messages_and_choices",
    });
    expect(await store.blobs.list(PAYLOADS_PREFIX)).toEqual(before);
  });
});
