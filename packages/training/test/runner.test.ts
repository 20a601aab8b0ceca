import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createWasmKernels } from "@arbor/engine/kernels";
import type { SftExample } from "@arbor/engine/train";
import { openStore, type Store } from "@arbor/store";
import { pino } from "pino";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { readCheckpointFiles } from "../src/checkpoints.ts";
import { createDataset } from "../src/datasets/datasets.ts";
import {
  enqueueRlJob,
  enqueueSftJob,
  MAX_JOB_EXAMPLES,
  MAX_VALIDATION_EXAMPLES,
} from "../src/jobs.ts";
import { stopWords, writeCancelled, writeStopping } from "../src/runner/cancel.ts";
import { baseModels, sftExamplesLoader } from "../src/runner/loaders.ts";
import {
  type TrainingActivity,
  TrainingWorker,
  type TrainingWorkerOptions,
} from "../src/runner/runner.ts";

/** The runner, without HTTP: a job's size is bounded before its first step. */
let dataDir: string;
let store: Store;
beforeAll(async () => {
  dataDir = mkdtempSync(join(tmpdir(), "arbor-runner-"));
  store = await openStore({ dataDir });
  await store.entities.ensure("e");
});
afterAll(async () => {
  await store.close();
  rmSync(dataDir, { recursive: true, force: true });
});

const example: SftExample = {
  messages: [
    { role: "user", content: "Hi" },
    { role: "assistant", content: "Hello" },
  ],
};

describe("TrainingWorker.runJob", () => {
  it("when an SFT job would train on more examples than a job may, then it fails before its first step, naming the limit", async () => {
    const { model } = await store.models.create({
      entity: "e",
      project: "p",
      name: "big",
      base_model: "arbor/tiny-chat",
      initialCheckpoint: {},
    });
    const lines = Math.floor(MAX_JOB_EXAMPLES / 1000) + 1;
    const activity: TrainingActivity[] = [];
    const worker = new TrainingWorker({
      store,
      logger: pino({ level: "silent" }),
      loadBaseModel: baseModels(),
      loadSftExamples: async () => Array.from({ length: lines }, () => example),
      onActivity: (a) => activity.push(a),
    });
    await store.jobs.enqueue({
      type: "sft",
      model_id: model.id,
      entity: "e",
      config: { config: { epochs: 1000 }, experimental_config: {} },
      payload_ref: "https://data.example/big.jsonl",
    });
    const job = await store.jobs.claimNextJob(worker.workerId, 60_000);
    await worker.runJob(job!);
    const after = await store.jobs.get("e", job!.id);
    expect(after?.status).toBe("failed");
    expect(after?.error_message).toContain(`limit of ${MAX_JOB_EXAMPLES}`);
    const events = (await store.jobs.listEvents("e", job!.id)).data;
    expect(events.map((e) => e.type)).toEqual(["training_failed"]);
    expect(activity).toEqual([
      { type: "ended", jobType: "sft", outcome: "failed", seconds: expect.any(Number) },
    ]);
  });

  it("when a fetched validation set holds more examples than a validation set may, then the job fails before its first step, naming the limit and the file", async () => {
    const { model } = await store.models.create({
      entity: "e",
      project: "p",
      name: "big-validation",
      base_model: "arbor/tiny-chat",
      initialCheckpoint: {},
    });
    const worker = new TrainingWorker({
      store,
      logger: pino({ level: "silent" }),
      loadBaseModel: baseModels(),
      loadSftExamples: async (_entity, url) =>
        Array.from(
          { length: url.endsWith("held-out.jsonl") ? MAX_VALIDATION_EXAMPLES + 1 : 1 },
          () => example,
        ),
    });
    await store.jobs.enqueue({
      type: "sft",
      model_id: model.id,
      entity: "e",
      config: {
        config: {},
        experimental_config: {},
        validation_data_url: "https://data.example/held-out.jsonl",
      },
      payload_ref: "https://data.example/train.jsonl",
    });
    const job = await store.jobs.claimNextJob(worker.workerId, 60_000);
    await worker.runJob(job!);
    const after = await store.jobs.get("e", job!.id);
    expect(after?.status).toBe("failed");
    expect(after?.error_message).toBe(
      `The validation set (https://data.example/held-out.jsonl) has ${MAX_VALIDATION_EXAMPLES + 1} examples, more than the limit of ${MAX_VALIDATION_EXAMPLES}: validate on a sample of it.`,
    );
    const events = (await store.jobs.listEvents("e", job!.id)).data;
    expect(events.map((e) => e.type)).toEqual(["training_failed"]);
  });

  function worker(options: Partial<TrainingWorkerOptions> = {}) {
    return new TrainingWorker({
      store,
      logger: pino({ level: "silent" }),
      loadBaseModel: baseModels(),
      loadSftExamples: sftExamplesLoader(store, { maxBytes: 1 << 20, allowHosts: [] }),
      ...options,
    });
  }

  /**
   * Kernels whose "wasm32" arena is 16 MiB, which holds tiny-chat's weights but not a training
   * pass beside them; the Memory64 one is real unless `small64`. `made` records which were made.
   */
  function smallArena(made: boolean[], small64 = false) {
    return (memory64: boolean) => {
      made.push(memory64);
      return createWasmKernels("simd", {
        memory64,
        ...(!memory64 || small64 ? { memoryLimit: 16 << 20 } : {}),
      });
    };
  }

  /** A queued SFT job of 100 one-example steps on a new model: long enough to cancel. */
  async function longSftJob(name: string) {
    const text = `${Array.from({ length: 4 }, (_, i) =>
      JSON.stringify({
        messages: [
          { role: "user", content: `Say ${i}` },
          { role: "assistant", content: `${i}` },
        ],
      }),
    ).join("\n")}\n`;
    const dataset = await createDataset(store, { entity: "e", name: null, text });
    return enqueueSftJob(store, await model(name), {
      training_data_url: `dataset://${dataset.id}`,
      config: { batch_size: 1, epochs: 25 },
    });
  }

  async function model(name: string) {
    return (
      await store.models.create({
        entity: "e",
        project: "p",
        name,
        base_model: "arbor/tiny-chat",
        initialCheckpoint: { step: 0, blob_key: null },
      })
    ).model;
  }

  async function runNext(w: TrainingWorker) {
    const job = await store.jobs.claimNextJob(w.workerId, 60_000);
    expect(job).toBeDefined();
    await w.runJob(job!);
    return (await store.jobs.get("e", job!.id))!;
  }

  it("when an SFT job runs, then it trains every planned step, saves the checkpoints it was asked for, and ends once", async () => {
    const m = await model("sft");
    const text = `${Array.from({ length: 6 }, (_, i) =>
      JSON.stringify({
        messages: [
          { role: "user", content: `Say ${i}` },
          { role: "assistant", content: `${i}` },
        ],
      }),
    ).join("\n")}\n`;
    const dataset = await createDataset(store, { entity: "e", name: null, text });
    await enqueueSftJob(store, m, {
      training_data_url: `dataset://${dataset.id}`,
      config: { batch_size: 2, epochs: 2, checkpoint_every: 2 },
      experimental_config: { lora_rank: 4, seed: 3 },
    });
    const activity: TrainingActivity[] = [];
    const job = await runNext(worker({ onActivity: (a) => activity.push(a) }));
    expect(job).toMatchObject({
      status: "succeeded",
      step_from: 0,
      step_to: 6,
      error_message: null,
    });
    const events = (await store.jobs.listEvents("e", job.id, { limit: 100 })).data;
    // What the worker reports for metrics: each step's tokens, as its event says, then the end.
    const stepTokens = events
      .filter((e) => e.type === "gradient_step")
      .map((e) => ({
        type: "tokens",
        jobType: "sft",
        tokens: (e.data as { num_tokens: number }).num_tokens,
      }));
    expect(activity).toEqual([
      ...stepTokens,
      { type: "ended", jobType: "sft", outcome: "succeeded", seconds: expect.any(Number) },
    ]);
    expect((activity.at(-1) as { seconds: number }).seconds).toBeGreaterThan(0);
    expect(events.map((e) => e.type)).toEqual([
      "training_started",
      ...Array.from({ length: 6 }, (_, i) =>
        i % 2 === 1 ? ["gradient_step", "checkpoint_saved"] : ["gradient_step"],
      ).flat(),
      "training_ended",
    ]);
    expect(events[0]!.data).toEqual({ num_sequences: 6 });
    const steps = (await store.models.listCheckpoints("e", m.id, { order: "asc" })).data;
    expect(steps.map((c) => c.step)).toEqual([0, 2, 4, 6]);
    const files = await readCheckpointFiles(store.blobs, steps.at(-1)!.blob_key!);
    const config = JSON.parse(new TextDecoder().decode(files["adapter_config.json"]!));
    expect(config).toMatchObject({ r: 4, base_model_name_or_path: "arbor/tiny-chat" });
    expect(files["optimizer.bin"]).toBeDefined();
  });

  it("when a step drives an adapter weight past the bound a checkpoint keeps to, then the job fails naming the tensor and saves no checkpoint", async () => {
    const m = await model("diverged");
    const text = `${JSON.stringify(example)}\n`;
    const dataset = await createDataset(store, { entity: "e", name: null, text });
    // A rate no request could ask for (the spec caps it at 1): Adam's first step moves every
    // weight of B by about the rate.
    await store.jobs.enqueue({
      type: "sft",
      model_id: m.id,
      entity: "e",
      config: { config: { batch_size: 1, learning_rate: [1e6] }, experimental_config: {} },
      payload_ref: `dataset://${dataset.id}`,
    });
    const job = await runNext(worker());
    expect(job.status).toBe("failed");
    expect(job.error_message).toMatch(
      /^Training diverged by step 1: base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_B\.weight holds -?\d+(\.\d+)? at index \d+; every weight must be a finite number of magnitude at most 65504\. No checkpoint was saved; a lower learning_rate may help\.$/,
    );
    const steps = (await store.models.listCheckpoints("e", m.id, { order: "asc" })).data;
    expect(steps.map((c) => c.step)).toEqual([0]);
    expect(await store.blobs.list(`checkpoints/${m.id}/`)).toEqual([]);
  });

  it("when a running job is cancelled, then it stops and reports the run as cancelled", async () => {
    const queued = await longSftJob("cancelled");
    const activity: TrainingActivity[] = [];
    const cancelled = new Int32Array(new SharedArrayBuffer(16));
    const w = worker({
      cancelled,
      onActivity: (a) => {
        activity.push(a);
        // Cancelled as it trains, as the server does it: the row, then the shared word that the
        // worker reads before its next step (a SQLite-backed worker never yields to a timer while
        // it trains).
        if (a.type === "tokens" && activity.length === 1) {
          void store.jobs.cancelJob("e", queued.id);
          writeCancelled(cancelled, queued.id);
        }
      },
    });
    const job = await runNext(w);
    expect(job.status).toBe("cancelled");
    // It stopped at once: one step trained, not the 100 planned.
    expect(activity.filter((a) => a.type === "tokens")).toHaveLength(1);
    expect(activity.at(-1)).toEqual({
      type: "ended",
      jobType: "sft",
      outcome: "cancelled",
      seconds: expect.any(Number),
    });
  });

  it("when a thread claims again a job whose earlier run it was told to stop, then the old word does not stop it", async () => {
    const queued = await longSftJob("requeued");
    const cancelled = new Int32Array(new SharedArrayBuffer(16));
    // Its earlier run on this thread lost its lease: the supervisor wrote the word, and the job
    // was requeued rather than cancelled.
    writeCancelled(cancelled, queued.id);
    const activity: TrainingActivity[] = [];
    const job = await runNext(worker({ onActivity: (a) => activity.push(a), cancelled }));
    expect(job.status).toBe("succeeded");
    expect(activity.at(-1)).toMatchObject({ type: "ended", outcome: "succeeded" });
  });

  it("when another cancel overwrites the shared word, then the cancelled job still stops within a step", async () => {
    const queued = await longSftJob("cancelled-twice");
    const activity: TrainingActivity[] = [];
    const cancelled = new Int32Array(new SharedArrayBuffer(16));
    const w = worker({
      cancelled,
      onActivity: (a) => {
        activity.push(a);
        if (a.type === "tokens" && activity.length === 1) {
          void store.jobs.cancelJob("e", queued.id).then(() => {
            writeCancelled(cancelled, queued.id);
            // A second cancel, of another job, before this thread looked.
            writeCancelled(cancelled, "01900000-0000-7000-8000-000000000000");
          });
        }
      },
    });
    const job = await runNext(w);
    expect(job.status).toBe("cancelled");
    // The row was checked before the next step's event: at most the step in flight ran.
    expect(activity.filter((a) => a.type === "tokens").length).toBeLessThanOrEqual(2);
  });

  it("when its worker is stopping (a shutdown) while a job trains, then the job goes back to the queue within the step, counted neither as a crash nor as an ended run, and nothing more is claimed", async () => {
    const queued = await longSftJob("deployed");
    const activity: TrainingActivity[] = [];
    const shared = stopWords();
    const w = worker({
      cancelled: shared,
      onActivity: (a) => {
        activity.push(a);
        // Written by the supervisor while the step computes; the stop message waits for it.
        if (a.type === "tokens" && activity.length === 1) writeStopping(shared);
      },
    });
    const job = await runNext(w);
    expect(job).toMatchObject({ status: "queued", lease_owner: null, crashes: 0, attempts: 1 });
    expect(activity.filter((a) => a.type === "tokens").length).toBeLessThanOrEqual(2);
    expect(activity.some((a) => a.type === "ended")).toBe(false);
    // The worker's loop sees the word before any message: it claims nothing more.
    w.start();
    await w.stop();
    expect((await store.jobs.get("e", queued.id))?.status).toBe("queued");
    await store.jobs.cancelJob("e", queued.id);
  });

  it("when the data has a bad line, then the job fails before its first step naming the line", async () => {
    const m = await model("bad-data");
    await store.blobs.put(
      "datasets/bad.jsonl",
      `{"messages": [{"role": "user", "content": "x"}]}\n`,
    );
    const dataset = await store.datasets.create({
      entity: "e",
      blob_key: "datasets/bad.jsonl",
      bytes: 10,
      lines: 1,
    });
    await enqueueSftJob(store, m, { training_data_url: `dataset://${dataset.id}` });
    const job = await runNext(worker());
    expect(job.status).toBe("failed");
    expect(job.error_message).toBe("Line 1: messages has no assistant message to learn from.");
    const events = (await store.jobs.listEvents("e", job.id)).data;
    expect(events.map((e) => e.type)).toEqual(["training_failed"]);
  });

  it("when the validation set has a bad line, then the job fails before its first step naming the line and the file", async () => {
    const m = await model("bad-validation");
    const good = await createDataset(store, {
      entity: "e",
      name: null,
      text: `${JSON.stringify(example)}\n`,
    });
    await store.blobs.put(
      "datasets/bad-validation.jsonl",
      `${JSON.stringify(example)}\n{"messages": [{"role": "user", "content": "x"}]}\n`,
    );
    const bad = await store.datasets.create({
      entity: "e",
      blob_key: "datasets/bad-validation.jsonl",
      bytes: 10,
      lines: 2,
    });
    await enqueueSftJob(store, m, {
      training_data_url: `dataset://${good.id}`,
      validation_data_url: `dataset://${bad.id}`,
    });
    const job = await runNext(worker());
    expect(job.status).toBe("failed");
    expect(job.error_message).toBe(
      `Validation data (dataset://${bad.id}): Line 2: messages has no assistant message to learn from.`,
    );
    const events = (await store.jobs.listEvents("e", job.id)).data;
    expect(events.map((e) => e.type)).toEqual(["training_failed"]);
  });

  it("when a job needs more memory than a wasm32 arena holds, then it trains on a Memory64 one, which the base model's later jobs start on", async () => {
    const made: boolean[] = [];
    const w = worker({ createKernels: smallArena(made) });
    const dataset = await createDataset(store, {
      entity: "e",
      name: null,
      text: `${JSON.stringify(example)}\n`,
    });
    const sft = async (name: string) => {
      await enqueueSftJob(store, await model(name), {
        training_data_url: `dataset://${dataset.id}`,
        config: { batch_size: 1, epochs: 2 },
      });
      return runNext(w);
    };
    const first = await sft("wide-1");
    expect(first).toMatchObject({ status: "succeeded", step_to: 2, error_message: null });
    expect(made).toEqual([false, true]);
    // Nothing was reported of the try on the small arena.
    const events = (await store.jobs.listEvents("e", first.id, { limit: 100 })).data;
    expect(events.map((e) => e.type)).toEqual([
      "training_started",
      "gradient_step",
      "gradient_step",
      "checkpoint_saved",
      "training_ended",
    ]);
    // The next job of that base goes to the Memory64 arena at once, and reuses it.
    expect(await sft("wide-2")).toMatchObject({ status: "succeeded", step_to: 2 });
    expect(made).toEqual([false, true]);
  });

  it("when a job does not fit even a Memory64 arena, then it fails before its first step, naming the memory needed and available", async () => {
    const made: boolean[] = [];
    const w = worker({
      loadSftExamples: async () => [example],
      createKernels: smallArena(made, true),
    });
    await enqueueSftJob(store, await model("too-wide"), {
      training_data_url: "https://data.example/one.jsonl",
    });
    const job = await runNext(w);
    expect(job.status).toBe("failed");
    expect(job.error_message).toMatch(
      /^not enough engine memory to train on a \d+-token sequence: it needs 0\.0\d GB .* and the engine has 0\.02 GB/,
    );
    // The message is the Memory64 arena's, the second one tried.
    expect(made).toEqual([false, true]);
    const events = (await store.jobs.listEvents("e", job.id)).data;
    expect(events.map((e) => e.type)).toEqual(["training_failed"]);
  });

  /** An RL job of two groups (one of them all equal rewards, skipped) on a new model. */
  async function rlJob(name: string) {
    const m = await model(name);
    const choice = (content: string) => ({
      index: 0,
      message: { role: "assistant" as const, content },
      finish_reason: "stop",
    });
    const trajectory = (content: string, reward: number) => ({
      messages_and_choices: [{ role: "user" as const, content: "Say yes" }, choice(content)],
      reward,
    });
    await enqueueRlJob(store, m, {
      trajectory_groups: [
        { trajectories: [trajectory("yes", 1), trajectory("no", 0)] },
        { trajectories: [trajectory("a", 1), trajectory("b", 1)] },
      ],
      experimental_config: { loss_fn: "pg", learning_rate: 1e-3 },
    });
    return m;
  }

  it("when an RL step needs more memory than a wasm32 arena holds, then it is taken on a Memory64 one, once", async () => {
    const made: boolean[] = [];
    const w = worker({ createKernels: smallArena(made) });
    const m = await rlJob("rl-wide");
    const job = await runNext(w);
    expect(job).toMatchObject({ status: "succeeded", step_to: 1 });
    expect(made).toEqual([false, true]);
    const events = (await store.jobs.listEvents("e", job.id)).data;
    expect(events.map((e) => e.type)).toEqual([
      "training_started",
      "gradient_step",
      "checkpoint_saved",
      "training_ended",
    ]);
    expect((await store.models.get("e", m.id))?.latest_step).toBe(1);
  });

  it("when an RL job runs, then one step is taken on its groups and checkpoint step 1 is written", async () => {
    const m = await rlJob("rl");
    const activity: TrainingActivity[] = [];
    const job = await runNext(worker({ onActivity: (a) => activity.push(a) }));
    expect(job).toMatchObject({ status: "succeeded", step_to: 1 });
    const events = (await store.jobs.listEvents("e", job.id)).data;
    expect(events.map((e) => e.type)).toEqual([
      "training_started",
      "gradient_step",
      "checkpoint_saved",
      "training_ended",
    ]);
    expect(events[0]!.data).toEqual({ num_sequences: 1, skipped_groups: 1 });
    expect(events[1]!.data).toMatchObject({ num_groups_trainable: 1, num_groups_skipped: 1 });
    expect(activity).toEqual([
      {
        type: "tokens",
        jobType: "rl",
        tokens: (events[1]!.data as { num_tokens: number }).num_tokens,
      },
      { type: "ended", jobType: "rl", outcome: "succeeded", seconds: expect.any(Number) },
    ]);
    expect((await store.models.get("e", m.id))?.latest_step).toBe(1);
  });
});
