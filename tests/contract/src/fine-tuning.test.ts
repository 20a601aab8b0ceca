import { createReadStream, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { setTimeout as delay } from "node:timers/promises";
import OpenAI, { APIError, toFile } from "openai";
import type { FineTuningJob } from "openai/resources/fine-tuning/jobs";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { reversal } from "./jobs.ts";

/**
 * OpenAI's fine-tuning API (ADR 70) driven by the stock `openai` npm client, unchanged: files
 * uploaded as it streams them, jobs created, polled, paged, paused, resumed and cancelled, and
 * the fine-tuned model chatted with.
 */
const BASE = "arbor/tiny-chat";
const words = ["cat", "dog", "sun", "map", "pen", "cup", "hat", "box", "bus", "owl", "fig", "jam"];
let server: RunningServer;
let openai: OpenAI;
let dir: string;
beforeAll(async () => {
  server = await startServer({}, { worker: true });
  openai = new OpenAI({ baseURL: `${server.baseUrl}/v1`, apiKey: server.adminKey, maxRetries: 0 });
  dir = mkdtempSync(join(tmpdir(), "arbor-ft-"));
});
afterAll(async () => {
  await server.close();
  rmSync(dir, { recursive: true, force: true });
});

/** A JSONL file on disk, uploaded as openai-node streams a file (chunked, no length). */
async function upload(name: string, lines: readonly unknown[]) {
  const path = join(dir, name);
  writeFileSync(path, lines.map((l) => JSON.stringify(l)).join("\n"));
  return openai.files.create({ file: createReadStream(path), purpose: "fine-tune" });
}

/** Polls as an OpenAI user does, until the job's status is one of `statuses`. */
async function until(id: string, statuses: readonly FineTuningJob["status"][] | string[]) {
  for (;;) {
    const job = await openai.fineTuning.jobs.retrieve(id);
    if ((statuses as string[]).includes(job.status)) return job;
    await delay(100);
  }
}

async function refused(promise: Promise<unknown>): Promise<APIError> {
  try {
    await promise;
  } catch (err) {
    if (err instanceof APIError) return err;
    throw err;
  }
  throw new Error("expected the request to be refused");
}

/** What the supervised job below made, shared by the tests that read it. */
let trained: Promise<FineTuningJob>;
function supervisedJob(): Promise<FineTuningJob> {
  trained ??= (async () => {
    const file = await upload("reverse.jsonl", words.map(reversal));
    const held = await upload("held-out.jsonl", ["ant", "bee", "elk"].map(reversal));
    const created = await openai.fineTuning.jobs.create({
      model: BASE,
      training_file: file.id,
      validation_file: held.id,
      suffix: "rev",
      seed: 7,
      metadata: { team: "a" },
      method: {
        type: "supervised",
        supervised: {
          hyperparameters: { n_epochs: 3, batch_size: 4, learning_rate_multiplier: 3 },
        },
      },
    });
    expect(created).toMatchObject({
      object: "fine_tuning.job",
      model: BASE,
      training_file: file.id,
      validation_file: held.id,
      seed: 7,
      metadata: { team: "a" },
      fine_tuned_model: null,
      organization_id: "default",
      hyperparameters: { n_epochs: 3, batch_size: 4, learning_rate_multiplier: 3 },
      method: { type: "supervised" },
    });
    expect(created.id).toMatch(/^ftjob-[0-9a-f]{32}$/);
    expect(["queued", "running"]).toContain(created.status);
    return until(created.id, ["succeeded", "failed", "cancelled"]);
  })();
  return trained;
}

/** Arbor's training job behind a fine-tuning job (a field OpenAI's type does not list). */
const trainingJobOf = (job: FineTuningJob) =>
  (job as unknown as { training_job_id: string }).training_job_id;

describe("createFile", () => {
  it("when a file is uploaded chunked, then it is processed and is one of the entity's datasets", async () => {
    const file = await upload("train.jsonl", words.map(reversal));
    expect(file).toMatchObject({
      object: "file",
      filename: "train.jsonl",
      purpose: "fine-tune",
      status: "processed",
    });
    expect(file.id).toMatch(/^file-[0-9a-f]{32}$/);
    const datasets = await server.authorizedClient().training.datasets.list();
    expect(datasets.data.map((d) => `file-${d.id.replaceAll("-", "")}`)).toContain(file.id);
  });

  it("when a line is not a fine-tuning example, then 400 names the line and nothing is stored", async () => {
    const before = (await server.authorizedClient().training.datasets.list()).data.length;
    const err = await refused(
      upload("bad.jsonl", [reversal("cat"), { prompt: "x", completion: "y" }]),
    );
    expect(err.status).toBe(400);
    expect(err.code).toBe("invalid_file_format");
    expect(err.param).toBe("file");
    expect(err.message).toMatch(/line 2/i);
    const wrongPurpose = await refused(
      openai.files.create({
        file: await toFile(Buffer.from("{}"), "x.jsonl"),
        purpose: "assistants",
      }),
    );
    expect(wrongPurpose.status).toBe(400);
    expect(wrongPurpose.param).toBe("purpose");
    expect((await server.authorizedClient().training.datasets.list()).data.length).toBe(before);
  });
});

describe("retrieveFile", () => {
  it("when the owner asks, then it reads the file; another entity reads it as not found", async () => {
    const file = await upload("mine.jsonl", [reversal("emu")]);
    expect(await openai.files.retrieve(file.id)).toEqual(file);
    const other = await server.newTenant("ft-other");
    const theirs = new OpenAI({
      baseURL: `${server.baseUrl}/v1`,
      apiKey: other.apiKey,
      maxRetries: 0,
    });
    expect((await refused(theirs.files.retrieve(file.id))).status).toBe(404);
    expect((await refused(theirs.files.delete(file.id))).status).toBe(404);
    const err = await refused(
      theirs.fineTuning.jobs.create({ model: BASE, training_file: file.id }),
    );
    expect(err.status).toBe(400);
    expect(err.param).toBe("training_file");
  });
});

describe("listFiles", () => {
  it("when files are paged one at a time, then the client reaches every one, newest first", async () => {
    const a = await upload("a.jsonl", [reversal("ant")]);
    const b = await upload("b.jsonl", [reversal("bee")]);
    const listed: string[] = [];
    for await (const f of openai.files.list({ limit: 1 })) listed.push(f.id);
    expect(listed.indexOf(b.id)).toBeLessThan(listed.indexOf(a.id));
    expect(listed.indexOf(a.id)).toBeGreaterThanOrEqual(0);
  });
});

describe("retrieveFileContent", () => {
  it("when the content is read, then it is the bytes uploaded", async () => {
    const file = await upload("content.jsonl", words.map(reversal));
    const content = await (await openai.files.content(file.id)).text();
    expect(content).toBe(words.map((w) => JSON.stringify(reversal(w))).join("\n"));
    expect(file.bytes).toBe(Buffer.byteLength(content));
  });
});

describe("deleteFile", () => {
  it("when a file no job reads is deleted, then it is gone", async () => {
    const gone = await upload("gone.jsonl", [reversal("ant")]);
    expect(await openai.files.delete(gone.id)).toEqual({
      id: gone.id,
      object: "file",
      deleted: true,
    });
    expect((await refused(openai.files.retrieve(gone.id))).status).toBe(404);
  });

  it("when a file is read by a job that has not ended, then it cannot be deleted until the job ends", async () => {
    const file = await upload("busy.jsonl", words.map(reversal));
    const created = await openai.fineTuning.jobs.create({
      model: BASE,
      training_file: file.id,
      hyperparameters: { n_epochs: 50, batch_size: 1 },
    });
    const err = await refused(openai.files.delete(file.id));
    expect(err.status).toBe(409);
    expect(err.code).toBe("file_in_use");
    await openai.fineTuning.jobs.cancel(created.id);
    expect((await openai.files.delete(file.id)).deleted).toBe(true);
  });
});

describe("createFineTuningJob", () => {
  it("when a supervised job runs, then it succeeds and its model answers differently from the base", async () => {
    const job = await supervisedJob();
    expect(job.status).toBe("succeeded");
    expect(job.error).toBeNull();
    expect(job.fine_tuned_model).toMatch(/^ft:tiny-chat:default:rev:[0-9a-f]{8}$/);
    expect(job.trained_tokens).toBeGreaterThan(0);
    expect(job.finished_at).toBeGreaterThanOrEqual(job.created_at);
    const ask = (model: string) =>
      openai.chat.completions.create({
        model,
        messages: [{ role: "user", content: "Reverse the word cat." }],
        max_tokens: 8,
        temperature: 0,
      });
    const base = await ask(BASE);
    const tuned = await ask(job.fine_tuned_model!);
    expect(tuned.model).toBe(job.fine_tuned_model);
    expect(tuned.choices[0]!.message.content).not.toBe(base.choices[0]!.message.content);
    expect((await openai.models.retrieve(job.fine_tuned_model!)).id).toBe(job.fine_tuned_model);
    const models: string[] = [];
    for await (const m of openai.models.list()) models.push(m.id);
    expect(models).toContain(job.fine_tuned_model);
    // The same job through the training API.
    const arbor = server.authorizedClient();
    expect((await arbor.training.jobs.retrieve(trainingJobOf(job))).status).toBe("succeeded");
  });

  it("when the request names what cannot be trained, then 400 names the parameter", async () => {
    const file = await upload("ok.jsonl", [reversal("cat")]);
    const cases: [Parameters<typeof openai.fineTuning.jobs.create>[0], string][] = [
      [{ model: BASE, training_file: "file-00000000000000000000000000000000" }, "training_file"],
      [{ model: "gpt-4o-mini", training_file: file.id }, "model"],
      [{ model: "ft:tiny-chat:default::00000000", training_file: file.id }, "model"],
      [
        {
          model: BASE,
          training_file: file.id,
          method: {
            type: "reinforcement",
            reinforcement: {
              grader: {
                type: "string_check",
                name: "g",
                input: "x",
                reference: "y",
                operation: "eq",
              },
            },
          },
        },
        "method.type",
      ],
    ];
    for (const [body, param] of cases) {
      const err = await refused(openai.fineTuning.jobs.create(body));
      expect(err.status).toBe(400);
      expect(err.param).toBe(param);
    }
    const chat = openai.chat.completions.create({
      model: "ft:tiny-chat:default::00000000",
      messages: [{ role: "user", content: "hi" }],
    });
    expect((await refused(chat)).status).toBe(404);
  });
});

describe("createFineTuningJob with method dpo", () => {
  /** A preference pair in OpenAI's DPO format: the reversed word preferred to the word. */
  const pair = (word: string) => ({
    input: { messages: [{ role: "user", content: `Reverse the word ${word}.` }] },
    preferred_output: [{ role: "assistant", content: [...word].reverse().join("") }],
    non_preferred_output: [{ role: "assistant", content: word }],
  });

  it("when a DPO job runs on preference pairs, then it succeeds, reports DPO's rewards and its model answers", async () => {
    const file = await upload("pairs.jsonl", words.slice(0, 8).map(pair));
    const created = await openai.fineTuning.jobs.create({
      model: BASE,
      training_file: file.id,
      suffix: "pref",
      method: { type: "dpo", dpo: { hyperparameters: { beta: 0.2, n_epochs: 2, batch_size: 4 } } },
    });
    expect(created).toMatchObject({
      method: { type: "dpo", dpo: { hyperparameters: { beta: 0.2, n_epochs: 2, batch_size: 4 } } },
      hyperparameters: { beta: 0.2, n_epochs: 2, batch_size: 4, learning_rate_multiplier: 1 },
    });
    const job = await until(created.id, ["succeeded", "failed", "cancelled"]);
    expect(job.status).toBe("succeeded");
    const events = [];
    for await (const event of openai.fineTuning.jobs.listEvents(job.id)) events.push(event);
    const steps = events
      .filter((e) => e.type === "metrics")
      .map((e) => e.data as { step: number; reward_margin: number; reward_accuracy: number });
    expect(steps.map((m) => m.step)).toEqual([4, 3, 2, 1]);
    for (const m of steps) expect(typeof m.reward_margin).toBe("number");
    // Trained towards the preferred answers: the margin grows from the first step to the last.
    expect(steps[0]!.reward_margin).toBeGreaterThan(steps.at(-1)!.reward_margin);
    const answer = await openai.chat.completions.create({
      model: job.fine_tuned_model!,
      messages: [{ role: "user", content: "Reverse the word cat." }],
      max_tokens: 4,
    });
    expect(answer.model).toBe(job.fine_tuned_model);
  });

  it("when the file's lines are not the method's, then 400 names the training file", async () => {
    const sft = await upload("sft-lines.jsonl", [reversal("cat")]);
    const pairs = await upload("pair-lines.jsonl", [pair("cat")]);
    const cases: Parameters<typeof openai.fineTuning.jobs.create>[0][] = [
      { model: BASE, training_file: sft.id, method: { type: "dpo" } },
      { model: BASE, training_file: pairs.id },
    ];
    for (const body of cases) {
      const err = await refused(openai.fineTuning.jobs.create(body));
      expect(err.status).toBe(400);
      expect(err.param).toBe("training_file");
      expect(err.code).toBe("dataset_method_mismatch");
    }
  });
});

describe("retrieveFineTuningJob", () => {
  it("when the job is unknown or another entity's, then 404", async () => {
    const missing = openai.fineTuning.jobs.retrieve("ftjob-00000000000000000000000000000000");
    expect((await refused(missing)).status).toBe(404);
    const job = await supervisedJob();
    const other = await server.newTenant("ft-stranger");
    const theirs = new OpenAI({
      baseURL: `${server.baseUrl}/v1`,
      apiKey: other.apiKey,
      maxRetries: 0,
    });
    expect((await refused(theirs.fineTuning.jobs.retrieve(job.id))).status).toBe(404);
    expect(
      (
        await refused(
          theirs.chat.completions.create({
            model: job.fine_tuned_model!,
            messages: [{ role: "user", content: "hi" }],
          }),
        )
      ).status,
    ).toBe(404);
  });
});

describe("listFineTuningJobs", () => {
  it("when jobs are filtered by metadata, then only those with every pair are listed", async () => {
    const job = await supervisedJob();
    const mine: string[] = [];
    for await (const j of openai.fineTuning.jobs.list({ metadata: { team: "a" }, limit: 1 }))
      mine.push(j.id);
    expect(mine).toContain(job.id);
    const others: string[] = [];
    for await (const j of openai.fineTuning.jobs.list({ metadata: { team: "b" } }))
      others.push(j.id);
    expect(others).not.toContain(job.id);
  });
});

describe("listFineTuningEvents", () => {
  it("when the events are paged two at a time, then they come newest first, once each, a metrics event per step", async () => {
    const job = await supervisedJob();
    const events = [];
    for await (const event of openai.fineTuning.jobs.listEvents(job.id, { limit: 2 }))
      events.push(event);
    expect(new Set(events.map((e) => e.id)).size).toBe(events.length);
    expect(events[0]!.message).toBe("The job has successfully completed.");
    expect(events.at(-1)!.message).toBe(`Created fine-tuning job: ${job.id}`);
    type Metrics = { step: number; total_steps: number; train_loss?: number; valid_loss?: number };
    const metrics = events.filter((e) => e.type === "metrics").map((e) => e.data as Metrics);
    const train = metrics.filter((m) => m.train_loss !== undefined);
    expect(train.map((m) => m.step)).toEqual([9, 8, 7, 6, 5, 4, 3, 2, 1]);
    expect(train[0]!.total_steps).toBe(9);
    expect(train[0]!.train_loss!).toBeLessThan(train.at(-1)!.train_loss!);
    expect(train[0]).toMatchObject({ train_mean_token_accuracy: expect.any(Number) });
    // The held-out file is scored before the first step, at each checkpoint and at the end.
    const valid = metrics.filter((m) => m.valid_loss !== undefined);
    expect(valid.map((m) => m.step)).toEqual([9, 6, 3, 0]);
    expect(valid[0]!.valid_loss!).toBeLessThan(valid.at(-1)!.valid_loss!);
    expect(valid[0]).toMatchObject({ valid_mean_token_accuracy: expect.any(Number) });
  });
});

describe("listFineTuningJobCheckpoints", () => {
  it("when the checkpoints are listed, then there is one per epoch, newest first, each chat-able", async () => {
    const job = await supervisedJob();
    const checkpoints = [];
    for await (const c of openai.fineTuning.jobs.checkpoints.list(job.id, { limit: 2 }))
      checkpoints.push(c);
    expect(checkpoints.map((c) => c.step_number)).toEqual([9, 6, 3]);
    expect(checkpoints[0]).toMatchObject({
      object: "fine_tuning.job.checkpoint",
      fine_tuning_job_id: job.id,
      fine_tuned_model_checkpoint: `${job.fine_tuned_model}:ckpt-step-9`,
      metrics: {
        step: 9,
        train_loss: expect.any(Number),
        train_mean_token_accuracy: expect.any(Number),
        valid_loss: expect.any(Number),
        valid_mean_token_accuracy: expect.any(Number),
      },
    });
    const early = await openai.chat.completions.create({
      model: checkpoints[2]!.fine_tuned_model_checkpoint,
      messages: [{ role: "user", content: "Reverse the word cat." }],
      max_tokens: 4,
    });
    expect(early.model).toBe(checkpoints[2]!.fine_tuned_model_checkpoint);
  });
});

describe("pauseFineTuningJob", () => {
  it("when a job is paused, then it is not run until resumed, and then it succeeds", async () => {
    const file = await upload("pause.jsonl", words.map(reversal));
    const created = await openai.fineTuning.jobs.create({
      model: BASE,
      training_file: file.id,
      method: {
        type: "supervised",
        supervised: { hyperparameters: { n_epochs: 2, batch_size: 4 } },
      },
    });
    const paused = await openai.fineTuning.jobs.pause(created.id);
    expect(paused.status).toBe("paused");
    // Its thread lets it go; the worker does not take it again while it is paused.
    while (server.runningJobs().includes(trainingJobOf(paused))) await delay(50);
    expect((await openai.fineTuning.jobs.retrieve(created.id)).status).toBe("paused");
    const arbor = server.authorizedClient();
    expect((await arbor.training.jobs.retrieve(trainingJobOf(paused))).status).toBe("paused");
    expect((await refused(openai.fineTuning.jobs.pause(created.id))).status).toBe(409);

    const resumed = await openai.fineTuning.jobs.resume(created.id);
    expect(["queued", "running"]).toContain(resumed.status);
    const done = await until(created.id, ["succeeded", "failed", "cancelled"]);
    expect(done.status).toBe("succeeded");
  });
});

describe("resumeFineTuningJob", () => {
  it("when the job is not paused, then 409 job_not_paused", async () => {
    const job = await supervisedJob();
    const err = await refused(openai.fineTuning.jobs.resume(job.id));
    expect(err.status).toBe(409);
    expect(err.code).toBe("job_not_paused");
  });
});

describe("cancelFineTuningJob", () => {
  it("when a job is cancelled, then it ends cancelled, and a second cancel is 409", async () => {
    const file = await upload("cancel.jsonl", words.map(reversal));
    const created = await openai.fineTuning.jobs.create({
      model: BASE,
      training_file: file.id,
      hyperparameters: { n_epochs: 50, batch_size: 1 },
    });
    const cancelled = await openai.fineTuning.jobs.cancel(created.id);
    expect(cancelled.status).toBe("cancelled");
    expect(cancelled.fine_tuned_model).toBeNull();
    expect((await refused(openai.fineTuning.jobs.cancel(created.id))).status).toBe(409);
  });
});
