import { type ArborClient, unwrap } from "@arbor/client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { followAll, reversal } from "./jobs.ts";

/** Training jobs end to end on the shipped model: real steps, real checkpoints. */
const BASE = "arbor/tiny-chat";
let server: RunningServer;
let client: ArborClient;
beforeAll(async () => {
  server = await startServer({}, { worker: true });
  client = server.authorizedClient();
});
afterAll(() => server.close());

const words = ["cat", "dog", "sun", "map", "pen", "cup", "hat", "box", "bus", "owl", "fig", "jam"];

async function upload(lines: unknown[]): Promise<string> {
  const body = lines.map((l) => JSON.stringify(l)).join("\n");
  const dataset = await client.training.datasets.create(body);
  return dataset.url;
}

async function newModel(name: string): Promise<string> {
  return (await client.training.models.create({ project: "train", name, base_model: BASE })).id;
}

const follow = (jobId: string) => followAll(client, jobId);

describe("createSftTrainingJob", () => {
  it("when an SFT job runs, then it steps, saves checkpoints, ends once, and the checkpoint answers differently", async () => {
    const modelId = await newModel("reverser");
    const url = await upload(words.map(reversal));
    const job = await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: url,
      config: {
        epochs: 3,
        batch_size: 4,
        learning_rate: 3e-3,
        lr_schedule: "constant",
        checkpoint_every: 3,
      },
    });
    expect(job).toMatchObject({
      object: "training_job",
      type: "sft",
      model_id: modelId,
      step_from: 0,
      error_message: null,
    });
    expect(["queued", "running"]).toContain(job.status);

    const events = await follow(job.id);
    const types = events.map((e) => e.type);
    expect(types[0]).toBe("training_started");
    expect(events[0]!.data).toEqual({ num_sequences: 9 });
    expect(types.filter((t) => t === "gradient_step")).toHaveLength(9);
    expect(types.filter((t) => t === "training_ended" || t === "training_failed")).toEqual([
      "training_ended",
    ]);
    expect(types.at(-1)).toBe("training_ended");
    expect(
      events.filter((e) => e.type === "checkpoint_saved").map((e) => e.data.step as number),
    ).toEqual([3, 6, 9]);
    const steps = events
      .filter((e) => e.type === "gradient_step")
      .map((e) => e.data as Record<string, number>);
    for (const step of steps) {
      for (const key of [
        "loss",
        "grad_norm",
        "learning_rate",
        "num_tokens",
        "num_trainable_tokens",
        "tokens_per_second",
        "gradient_step",
      ]) {
        expect(typeof step[key]).toBe("number");
      }
    }
    expect(steps.at(-1)!.loss!).toBeLessThan(steps[0]!.loss!);

    const done = await client.training.jobs.retrieve(job.id);
    expect(done).toMatchObject({
      status: "succeeded",
      step_from: 0,
      step_to: 9,
      error_message: null,
    });
    expect(done.training_end).toBeGreaterThanOrEqual(done.training_start!);

    const { data } = await client.training.models.checkpoints.list(modelId, { order: "asc" });
    expect(data.map((c) => c.step)).toEqual([0, 3, 6, 9]);

    const ask = async (model: string) =>
      await client.chat.completions.create({
        model,
        messages: [{ role: "user", content: "Reverse the word cat." }],
        max_tokens: 8,
        temperature: 0,
      });
    const before = await ask("default/train/reverser:step0");
    const after = await ask("default/train/reverser");
    expect(after.model).toBe("default/train/reverser:step9");
    expect(after.choices[0]!.message.content).not.toBe(before.choices[0]!.message.content);
  });

  it("when the model does not exist, then 404 and nothing is queued", async () => {
    const { response, error } = await client.POST("/v1/preview/sft-training-jobs", {
      body: {
        model_id: "0193a0b6-0a1b-7c2d-8e3f-4a5b6c7d8e9f",
        training_data_url: "dataset://nope",
      },
    });
    expect(response.status).toBe(404);
    expect((error as { error: { type: string } }).error.type).toBe("not_found_error");
  });

  it("when the dataset is unknown, then 404 dataset_not_found", async () => {
    const modelId = await newModel("nodata");
    const { response, error } = await client.POST("/v1/preview/sft-training-jobs", {
      body: { model_id: modelId, training_data_url: "dataset://missing" },
    });
    expect(response.status).toBe(404);
    expect((error as { error: { code: string } }).error.code).toBe("dataset_not_found");
    expect((await server.store.jobs.list("default", { model_id: modelId })).data).toEqual([]);
  });
});

describe("createSftTrainingJob with a validation set", () => {
  it("when a job has a validation set like its data, then validation events come at the start, every eval_every steps and the end, with finite numbers, the last loss lower than the first, and checkpoints keep theirs", async () => {
    const modelId = await newModel("validated");
    const url = await upload(words.map(reversal));
    const held = ["ant", "bee", "elk", "yak"];
    const validationUrl = await upload(held.map(reversal));
    const job = await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: url,
      validation_data_url: validationUrl,
      config: {
        epochs: 3,
        batch_size: 4,
        learning_rate: 3e-3,
        lr_schedule: "constant",
        checkpoint_every: 3,
        eval_every: 3,
      },
    });
    expect(job.config).toMatchObject({ validation_data_url: validationUrl });
    const events = await follow(job.id);
    expect(events.at(-1)!.type).toBe("training_ended");
    const validations = events.flatMap((e) => (e.type === "validation" ? [e.data] : []));
    expect(validations.map((v) => v.gradient_step)).toEqual([0, 3, 6, 9]);
    for (const v of validations) {
      expect(Number.isFinite(v.loss)).toBe(true);
      expect(v.mean_token_accuracy).toBeGreaterThanOrEqual(0);
      expect(v.mean_token_accuracy).toBeLessThanOrEqual(1);
      expect(v).toMatchObject({ num_examples: held.length });
      expect(v.num_trainable_tokens).toBeGreaterThan(0);
      expect(v.num_tokens).toBeGreaterThan(v.num_trainable_tokens);
    }
    expect(validations.at(-1)!.loss!).toBeLessThan(validations[0]!.loss!);
    // Before the first step there is no step to follow; each later one follows its step's event.
    const types = events.map((e) => e.type);
    expect(types.indexOf("validation")).toBeLessThan(types.indexOf("gradient_step"));
    for (const step of [3, 6, 9]) {
      const at = events.findIndex((e) => e.type === "validation" && e.data.gradient_step === step);
      expect(events[at - 1]).toMatchObject({
        type: "gradient_step",
        data: { gradient_step: step },
      });
    }
    const steps = events.flatMap((e) => (e.type === "gradient_step" ? [e.data] : []));
    for (const step of steps) expect(step.mean_token_accuracy).toEqual(expect.any(Number));

    const { data } = await client.training.models.checkpoints.list(modelId, { order: "asc" });
    expect(data.map((c) => [c.step, c.metrics["validation/loss"]])).toEqual([
      [0, undefined],
      [3, validations[1]!.loss],
      [6, validations[2]!.loss],
      [9, validations[3]!.loss],
    ]);
    expect(data.at(-1)!.metrics["validation/mean_token_accuracy"]).toBe(
      validations[3]!.mean_token_accuracy,
    );
  });

  it("when the validation file has a bad line, then the job fails before any step naming the line and the file", async () => {
    const modelId = await newModel("bad-validation");
    const url = await upload(words.slice(0, 4).map(reversal));
    // A file a client cannot upload (uploads are checked line by line): what an https:// URL
    // may serve. The harness has no TLS server, so it goes to the store as a dataset would.
    const text = `${JSON.stringify(reversal("ant"))}\n{"messages": [{"role": "user", "content": "no answer"}]}\n`;
    const dataset = await server.store.datasets.create({
      entity: "default",
      blob_key: `datasets/bad-validation-${modelId}.jsonl`,
      bytes: text.length,
      lines: 2,
    });
    await server.store.blobs.put(dataset.blob_key, text);
    const job = await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: url,
      validation_data_url: `dataset://${dataset.id}`,
    });
    const events = await follow(job.id);
    expect(events.map((e) => e.type)).toEqual(["training_failed"]);
    const message = `Validation data (dataset://${dataset.id}): Line 2: messages has no assistant message to learn from.`;
    expect(events[0]!.data).toEqual({ error_message: message });
    expect(await client.training.jobs.retrieve(job.id)).toMatchObject({
      status: "failed",
      error_message: message,
    });
  });

  it("when the validation URL is a W&B artifact, then 400 unsupported_validation_data_url and nothing is queued", async () => {
    const modelId = await newModel("wandb-validation");
    const url = await upload(words.slice(0, 4).map(reversal));
    const { response, error } = await client.POST("/v1/preview/sft-training-jobs", {
      body: {
        model_id: modelId,
        training_data_url: url,
        validation_data_url: "wandb-artifact:///default/train/held-out:v0",
      },
    });
    expect(response.status).toBe(400);
    expect(error).toMatchObject({
      error: {
        type: "invalid_request_error",
        code: "unsupported_validation_data_url",
        param: "validation_data_url",
        message: expect.stringContaining("dataset://"),
      },
    });
    expect((await server.store.jobs.list("default", { model_id: modelId })).data).toEqual([]);
  });
});

describe("createRlTrainingJob", () => {
  const choice = (content: string) => ({
    index: 0,
    finish_reason: "stop",
    message: { role: "assistant", content },
  });

  it.each([
    [
      "a trajectory with no trainable turn",
      { trajectories: [{ messages_and_choices: [{ role: "user", content: "1+1?" }], reward: 1 }] },
      "trajectory_groups[0].trajectories[0].messages_and_choices",
    ],
  ])("when given %s, then 400 naming it and nothing stored", async (_, group, param) => {
    const modelId = await newModel(`rl-bad-${param.length}`);
    const { response, error } = await client.POST("/v1/preview/training-jobs", {
      body: { model_id: modelId, trajectory_groups: [group] } as never,
    });
    expect(response.status).toBe(400);
    expect((error as { error: { param: string; code: string } }).error).toMatchObject({
      param,
      code: "invalid_trajectory",
    });
    expect((await server.store.jobs.list("default", { model_id: modelId })).data).toEqual([]);
  });

  it("when a reward is not a number, then 400 from validation", async () => {
    const modelId = await newModel("rl-reward");
    const { response } = await client.POST("/v1/preview/training-jobs", {
      body: {
        model_id: modelId,
        trajectory_groups: [
          {
            trajectories: [
              {
                messages_and_choices: [{ role: "user", content: "1+1?" }, choice("2")],
                reward: "high",
              },
            ],
          },
        ],
      } as never,
    });
    expect(response.status).toBe(400);
  });
});

describe("cancelTrainingJob", () => {
  it("when a queued job is cancelled, then it ends with training_failed cancelled, and a second cancel is 409", async () => {
    const modelId = await newModel("cancelled");
    const url = await upload(words.map(reversal));
    const first = await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: url,
      config: { epochs: 2 },
    });
    const second = await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: url,
    });
    const cancelled = await client.training.jobs.cancel(second.id);
    expect(cancelled.status).toBe("cancelled");
    expect(cancelled.error_message).toBe("cancelled");
    const events = await follow(second.id);
    expect(events.map((e) => [e.type, e.data])).toEqual([
      ["training_failed", { error_message: "cancelled" }],
    ]);
    const again = await client.POST("/v1/preview/training-jobs/{training_job_id}/cancel", {
      params: { path: { training_job_id: second.id } },
    });
    expect(again.response.status).toBe(409);
    await follow(first.id);
  });

  it("when a running job is cancelled, then its worker stops within the step it was in", async () => {
    const modelId = await newModel("cancelled-running");
    const url = await upload(words.map(reversal));
    const job = await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: url,
      config: { epochs: 500, batch_size: 1 },
    });
    // Cancel once it has trained a few steps.
    for await (const event of client.training.jobs.events.follow(job.id)) {
      if (event.type === "gradient_step" && Number(event.data.gradient_step) >= 3) break;
    }
    await client.training.jobs.cancel(job.id);
    while (server.runningJobs().includes(job.id)) await new Promise((r) => setTimeout(r, 20));
    const events = [];
    for await (const event of client.training.jobs.events.list(job.id, { limit: 100 }))
      events.push(event);
    const end = events.findIndex((e) => e.type === "training_failed");
    expect(events[end]?.data).toEqual({ error_message: "cancelled" });
    // The step in flight may finish and write its event; none after it. (A lease check alone
    // notices a cancel only after a heartbeat: many steps of this model.)
    expect(
      events.slice(end + 1).filter((e) => e.type === "gradient_step").length,
    ).toBeLessThanOrEqual(1);
    expect(events.filter((e) => e.type === "gradient_step").length).toBeLessThan(
      words.length * 500,
    );
  });
});

describe("listTrainingJobs", () => {
  it("when jobs are listed, then they come newest first, filtered by model, status and project", async () => {
    const modelId = await newModel("listed-jobs");
    const url = await upload(words.slice(0, 4).map(reversal));
    const jobs = [];
    for (let i = 0; i < 3; i++)
      jobs.push(
        await client.training.jobs.createSft({ model_id: modelId, training_data_url: url }),
      );
    for (const job of jobs) await follow(job.id);
    const page = unwrap(
      await client.GET("/v1/preview/training-jobs", {
        params: { query: { model_id: modelId, limit: 2 } },
      }),
    );
    expect(page.object).toBe("list");
    expect(page.data.map((j) => j.id)).toEqual([jobs[2]!.id, jobs[1]!.id]);
    expect(page.has_more).toBe(true);
    const all = [];
    for await (const job of client.training.jobs.list({ model_id: modelId, limit: 1 }))
      all.push(job);
    expect(all.map((j) => j.id)).toEqual(jobs.map((j) => j.id).reverse());
    expect(all[0]).toEqual(await client.training.jobs.retrieve(jobs[2]!.id));

    const succeeded = await client.training.jobs.list({ model_id: modelId, status: "succeeded" });
    expect(succeeded.data).toHaveLength(3);
    const running = await client.training.jobs.list({ model_id: modelId, status: "running" });
    expect(running.data).toEqual([]);
    const other = await client.training.jobs.list({ project: "no-such-project" });
    expect(other.data).toEqual([]);
    const inProject = [];
    for await (const job of client.training.jobs.list({ project: "train" })) inProject.push(job.id);
    expect(inProject).toEqual(expect.arrayContaining(jobs.map((j) => j.id)));

    const stranger = (await server.newTenant("job-lister")).client;
    expect((await stranger.training.jobs.list()).data).toEqual([]);
    const bad = await client.GET("/v1/preview/training-jobs", {
      params: { query: { status: "done" as never } },
    });
    expect(bad.response.status).toBe(400);
    expect(bad.error).toMatchObject({ error: { param: "status" } });
  });
});

describe("retrieveTrainingJob", () => {
  it("when an SFT job has stepped, then it shows its progress, and each checkpoint its step's training metrics", async () => {
    const modelId = await newModel("progress");
    const url = await upload(words.slice(0, 8).map(reversal));
    const job = await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: url,
      config: { epochs: 1, batch_size: 2, checkpoint_every: 2 },
    });
    expect(job.progress).toBeNull();
    const events = await follow(job.id);
    const steps = events.filter((e) => e.type === "gradient_step").map((e) => e.data);
    const last = steps.at(-1)!;
    const done = await client.training.jobs.retrieve(job.id);
    expect(done.progress).toEqual({ step: 4, total_steps: 4, loss: last.loss, reward: null });
    const listed = await client.training.jobs.list({ model_id: modelId });
    expect(listed.data[0]?.progress).toEqual(done.progress);
    const checkpoints = (await client.training.models.checkpoints.list(modelId, { order: "asc" }))
      .data;
    expect(checkpoints.map((c) => [c.step, c.metrics["train/loss"]])).toEqual([
      [0, undefined],
      [2, steps[1]!.loss],
      [4, steps[3]!.loss],
    ]);
    expect(checkpoints[2]!.metrics).toMatchObject({
      "train/grad_norm": steps[3]!.grad_norm,
      "train/learning_rate": steps[3]!.learning_rate,
      "train/num_tokens": steps[3]!.num_tokens,
    });
  });

  it("when a job was created with settings, then it shows them as given", async () => {
    const modelId = await newModel("shown-config");
    const url = await upload(words.slice(0, 4).map(reversal));
    const job = await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: url,
      config: { batch_size: 2, learning_rate: 0.003 },
      experimental_config: { lora_rank: 4 },
    });
    expect((await client.training.jobs.retrieve(job.id)).config).toEqual({
      config: { batch_size: 2, learning_rate: 0.003 },
      experimental_config: { lora_rank: 4 },
    });
    await follow(job.id);
  });

  it("when another entity asks for a job, then 404", async () => {
    const modelId = await newModel("secret-job");
    const url = await upload(words.slice(0, 4).map(reversal));
    const job = await client.training.jobs.createSft({ model_id: modelId, training_data_url: url });
    const stranger = (await server.newTenant("job-snoop")).client;
    const path = { params: { path: { training_job_id: job.id } } };
    for (const answer of await Promise.all([
      stranger.GET("/v1/preview/training-jobs/{training_job_id}", path),
      stranger.GET("/v1/preview/training-jobs/{training_job_id}/events", path),
      stranger.POST("/v1/preview/training-jobs/{training_job_id}/cancel", path),
    ])) {
      expect(answer.response.status).toBe(404);
    }
    await follow(job.id);
  });
});

describe("listTrainingJobEvents", () => {
  it("when paged by after, then every event comes once, in order", async () => {
    const modelId = await newModel("paged-events");
    const url = await upload(words.slice(0, 8).map(reversal));
    const job = await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: url,
      config: { batch_size: 2 },
    });
    const live = await follow(job.id);
    const paged = [];
    for await (const event of client.training.jobs.events.list(job.id, { limit: 2 })) {
      paged.push(event);
    }
    expect(paged).toEqual(live);
  });
});
