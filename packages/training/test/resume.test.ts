import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type JobEvent, openStore, type Store } from "@arbor/store";
import { pino } from "pino";
import { afterAll, describe, expect, it } from "vitest";
import { readCheckpointFiles } from "../src/checkpoints.ts";
import { createDataset } from "../src/datasets/datasets.ts";
import { enqueueRlJob, enqueueSftJob } from "../src/jobs.ts";
import { baseModels, dpoPairsLoader, sftExamplesLoader } from "../src/runner/loaders.ts";
import { TrainingWorker } from "../src/runner/runner.ts";

/**
 * A job whose worker dies mid-way and that another run resumes: its events read as one job,
 * each step reported once, the resume announced. On SQLite and on PostgreSQL.
 */
const dataDir = mkdtempSync(join(tmpdir(), "arbor-resume-"));
const PG_URL = process.env.ARBOR_TEST_PG ?? "postgres://postgres@127.0.0.1:5432/test";
const schema = `arbor_resume_${process.pid}_${Date.now()}`;

const sqlite = await openStore({ dataDir: join(dataDir, "sqlite") });
/** The PostgreSQL store, or why there is none (an error under `CI=true`: CI has one). */
const postgres: Store | string =
  process.env.ARBOR_TEST_PG === "off"
    ? "ARBOR_TEST_PG=off"
    : await openStore({ databaseUrl: PG_URL, schema, blobDir: join(dataDir, "pg-blobs") }).catch(
        (err: unknown) => {
          const reason = `PostgreSQL at ${PG_URL} is unreachable (${(err as Error).message})`;
          if (process.env.CI === "true") throw new Error(`${reason}; CI needs it.`);
          console.log(`[@arbor/training] ${reason}: the Postgres half is SKIPPED`);
          return reason;
        },
      );

afterAll(async () => {
  await sqlite.close();
  if (typeof postgres !== "string") {
    await postgres.sql.exec(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
    await postgres.close();
  }
  rmSync(dataDir, { recursive: true, force: true });
});

/**
 * The store as a worker that dies at the first call `dies` picks sees it: that call and every
 * later one fail, as if the process were gone, so it writes nothing more and its job stays
 * `running` under its lease.
 */
function dying(store: Store, dies: (call: string, args: unknown[]) => boolean): Store {
  let dead = false;
  const repo = <T extends object>(name: string, target: T): T =>
    new Proxy(target, {
      get(t, prop) {
        const value = Reflect.get(t, prop, t) as unknown;
        if (typeof value !== "function") return value;
        return (...args: unknown[]) => {
          dead ||= dies(`${name}.${String(prop)}`, args);
          if (dead) return Promise.reject(new Error("the worker died"));
          return (value as (...a: unknown[]) => unknown).apply(t, args);
        };
      },
    });
  return new Proxy(store, {
    get(t, prop) {
      const value = Reflect.get(t, prop, t) as unknown;
      return prop === "jobs" || prop === "models" || prop === "blobs"
        ? repo(String(prop), value as object)
        : value;
    },
  });
}

/** An event as the test reads it: `g3` (gradient step 3), `v3` (validation after step 3),
 * `c4` (checkpoint 4), `started`
 * (with `from K (attempt A)` when it resumes), or the type. */
function brief(event: JobEvent): string {
  const data = event.data as Record<string, unknown>;
  if (event.type === "gradient_step") return `g${String(data.gradient_step)}`;
  if (event.type === "validation") return `v${String(data.gradient_step)}`;
  if (event.type === "checkpoint_saved") return `c${String(data.step)}`;
  if (event.type === "training_started" && data.resumed_from_step !== undefined)
    return `started from ${String(data.resumed_from_step)} (attempt ${String(data.attempt)})`;
  if (event.type === "training_started") return "started";
  return event.type;
}

for (const [backend, store] of [
  ["sqlite", sqlite],
  ["postgres", postgres],
] as const) {
  describe.skipIf(typeof store === "string")(`a resumed job's events [${backend}]`, () => {
    const db = store as Store;
    let n = 0;

    function worker(s: Store, stable: string) {
      return new TrainingWorker({
        store: s,
        logger: pino({ level: "silent" }),
        loadBaseModel: baseModels(),
        loadSftExamples: sftExamplesLoader(db, { maxBytes: 1 << 20, allowHosts: [] }),
        loadDpoPairs: dpoPairsLoader(db, { maxBytes: 1 << 20, allowHosts: [] }),
        identity: { stable, persistent: true },
      });
    }

    async function model() {
      return (
        await db.models.create({
          entity: "e",
          project: "p",
          name: `m${++n}`,
          base_model: "arbor/tiny-chat",
          initialCheckpoint: { step: 0, blob_key: null },
        })
      ).model;
    }

    /** 6 steps (6 examples, batches of 2, 2 epochs), a checkpoint every 2, on `target` (a new
     * model by default); with `validate`, the same lines as a validation set, evaluated after
     * every step. */
    async function sftJob(
      options: { target?: Awaited<ReturnType<typeof model>>; validate?: boolean } = {},
    ) {
      const { target, validate = false } = options;
      await db.entities.ensure("e");
      const text = `${Array.from({ length: 6 }, (_, i) =>
        JSON.stringify({
          messages: [
            { role: "user", content: `Say ${i}` },
            { role: "assistant", content: `${i}` },
          ],
        }),
      ).join("\n")}\n`;
      const dataset = await createDataset(db, { entity: "e", name: null, text });
      return enqueueSftJob(db, target ?? (await model()), {
        training_data_url: `dataset://${dataset.id}`,
        ...(validate ? { validation_data_url: `dataset://${dataset.id}` } : {}),
        config: {
          batch_size: 2,
          epochs: 2,
          checkpoint_every: 2,
          ...(validate ? { eval_every: 1 } : {}),
        },
        experimental_config: { lora_rank: 4, seed: 3 },
      });
    }

    /** A DPO job (ADR 69) of 6 steps on `target`, as `sftJob`, on preference pairs. */
    async function dpoJob(target: Awaited<ReturnType<typeof model>>) {
      const text = Array.from({ length: 6 }, (_, i) =>
        JSON.stringify({
          input: { messages: [{ role: "user", content: `Say ${i}` }] },
          preferred_output: [{ role: "assistant", content: `${i}` }],
          non_preferred_output: [{ role: "assistant", content: `${i + 1}` }],
        }),
      ).join("\n");
      const dataset = await createDataset(db, { entity: "e", name: null, text });
      return enqueueSftJob(db, (await db.models.get("e", target.id))!, {
        training_data_url: `dataset://${dataset.id}`,
        config: { method: "dpo", dpo_beta: 0.5, batch_size: 2, epochs: 2, checkpoint_every: 2 },
        experimental_config: { lora_rank: 4, seed: 3 },
      });
    }

    async function rlJob() {
      await db.entities.ensure("e");
      const trajectory = (content: string, reward: number) => ({
        messages_and_choices: [
          { role: "user" as const, content: "Say yes" },
          { index: 0, message: { role: "assistant" as const, content }, finish_reason: "stop" },
        ],
        reward,
      });
      return enqueueRlJob(db, await model(), {
        trajectory_groups: [{ trajectories: [trajectory("yes", 1), trajectory("no", 0)] }],
        experimental_config: { loss_fn: "pg", learning_rate: 1e-3 },
      });
    }

    /** Claims `jobId` and runs it on `w`. */
    async function run(w: TrainingWorker, jobId: string) {
      const job = await db.jobs.claimNextJob(w.workerId, 60_000);
      expect(job?.id).toBe(jobId);
      await w.runJob(job!);
    }

    /** Runs the job on a worker that dies where `dies` says, then resumes it on another. */
    async function dieAndResume(jobId: string, dies: (call: string, args: unknown[]) => boolean) {
      const stable = `dying-${backend}-${++n}`;
      await run(worker(dying(db, dies), stable), jobId);
      expect((await db.jobs.get("e", jobId))?.status).toBe("running");
      // The dead worker's next boot takes its job back (as after its lease expired).
      const { requeued } = await db.jobs.reclaimOwnLeases(`${stable}#`, `${stable}#next`);
      expect(requeued.map((j) => j.id)).toEqual([jobId]);
      await run(worker(db, `resumer-${backend}`), jobId);
      const job = await db.jobs.get("e", jobId);
      const events = (await db.jobs.listEvents("e", jobId, { limit: 100 })).data;
      return { job: job!, events, steps: events.map(brief) };
    }

    const at =
      (call: string, type?: string, field?: string, value?: number) =>
      (c: string, args: unknown[]) =>
        c === call &&
        (type === undefined || args[1] === type) &&
        (field === undefined || (args[2] as Record<string, unknown>)[field] === value);

    it("when an SFT job dies after reporting a step past its checkpoint, then the resumed run says where it resumes and reports each step once", async () => {
      const queued = await sftJob();
      const { job, events, steps } = await dieAndResume(
        queued.id,
        at("jobs.appendEvent", "gradient_step", "gradient_step", 4),
      );
      // Step 3 ran twice (before the death, and again after checkpoint 2); its first report stands.
      expect(steps).toEqual([
        "started",
        "g1",
        "g2",
        "c2",
        "g3",
        "started from 2 (attempt 2)",
        "g4",
        "c4",
        "g5",
        "g6",
        "c6",
        "training_ended",
      ]);
      expect(events[5]!.data).toEqual({ num_sequences: 6, resumed_from_step: 2, attempt: 2 });
      expect(job).toMatchObject({ status: "succeeded", step_from: 0, step_to: 6, crashes: 1 });
      const checkpoints = (await db.models.listCheckpoints("e", job.model_id, { order: "asc" }))
        .data;
      expect(checkpoints.map((c) => c.step)).toEqual([0, 2, 4, 6]);
    });

    it("when an SFT job with a validation set dies before validating a step past its checkpoint, then each step's validation is reported once", async () => {
      const queued = await sftJob({ validate: true });
      const { job, events, steps } = await dieAndResume(
        queued.id,
        at("jobs.appendEvent", "validation", "gradient_step", 4),
      );
      // Steps 3 and 4 ran twice; v3 (and g3, g4) keep their first report, v4 comes from the resume.
      expect(steps).toEqual([
        "started",
        "v0",
        "g1",
        "v1",
        "g2",
        "v2",
        "c2",
        "g3",
        "v3",
        "g4",
        "started from 2 (attempt 2)",
        "v4",
        "c4",
        "g5",
        "v5",
        "g6",
        "v6",
        "c6",
        "training_ended",
      ]);
      expect(job).toMatchObject({ status: "succeeded", step_to: 6 });
      const validations = events.filter((e) => e.type === "validation");
      for (const v of validations) {
        expect(v.data).toEqual({
          gradient_step: expect.any(Number),
          loss: expect.any(Number),
          mean_token_accuracy: expect.any(Number),
          num_tokens: expect.any(Number),
          num_trainable_tokens: expect.any(Number),
          num_examples: 6,
        });
      }
      const loss = (step: number) =>
        (
          validations.find((v) => (v.data as { gradient_step: number }).gradient_step === step)!
            .data as { loss: number }
        ).loss;
      const checkpoints = (await db.models.listCheckpoints("e", job.model_id, { order: "asc" }))
        .data;
      expect(checkpoints.map((c) => c.metrics["validation/loss"])).toEqual([
        undefined,
        loss(2),
        loss(4),
        loss(6),
      ]);
    });

    it("when an SFT job dies between listing a checkpoint and its event, then the resumed run announces that checkpoint once", async () => {
      const queued = await sftJob();
      const { steps } = await dieAndResume(
        queued.id,
        at("jobs.appendEvent", "checkpoint_saved", "step", 4),
      );
      expect(steps).toEqual([
        "started",
        "g1",
        "g2",
        "c2",
        "g3",
        "g4",
        "c4",
        "started from 4 (attempt 2)",
        "g5",
        "g6",
        "c6",
        "training_ended",
      ]);
    });

    it("when an SFT job dies before it started training, then its next run's start is its first", async () => {
      const queued = await sftJob();
      const { job, steps } = await dieAndResume(
        queued.id,
        at("jobs.appendEvent", "training_started"),
      );
      expect(steps).toEqual([
        "started",
        "g1",
        "g2",
        "c2",
        "g3",
        "g4",
        "c4",
        "g5",
        "g6",
        "c6",
        "training_ended",
      ]);
      expect(job).toMatchObject({ status: "succeeded", attempts: 2 });
    });

    it("when a DPO job that continues an SFT checkpoint dies mid-way, then the resumed run keeps that checkpoint as its reference and ends as an unbroken run does", async () => {
      await db.entities.ensure("e");
      const ends: { adapter: Uint8Array; steps: unknown[] }[] = [];
      for (const dies of [false, true]) {
        const target = await model();
        await run(worker(db, `sft-${backend}-${++n}`), (await sftJob({ target })).id);
        const queued = await dpoJob(target);
        expect(queued.step_from).toBe(6);
        const { job, events, steps } = dies
          ? await dieAndResume(
              queued.id,
              at("jobs.appendEvent", "gradient_step", "gradient_step", 4),
            )
          : await (async () => {
              await run(worker(db, `dpo-${backend}-${++n}`), queued.id);
              const events = (await db.jobs.listEvents("e", queued.id, { limit: 100 })).data;
              return {
                job: (await db.jobs.get("e", queued.id))!,
                events,
                steps: events.map(brief),
              };
            })();
        expect(job).toMatchObject({ status: "succeeded", step_from: 6, step_to: 12 });
        if (dies) expect(steps).toContain("started from 2 (attempt 2)");
        const last = await db.models.getCheckpoint("e", job.model_id, 12);
        const files = await readCheckpointFiles(db.blobs, last!.blob_key!);
        ends.push({
          adapter: files["adapter_model.safetensors"]!,
          steps: events
            .filter((e) => e.type === "gradient_step")
            .map((e) => {
              const { tokens_per_second: _, ...data } = e.data as Record<string, unknown>;
              return data;
            }),
        });
      }
      const [unbroken, resumed] = ends;
      expect(resumed!.steps).toEqual(unbroken!.steps);
      expect((unbroken!.steps[0] as Record<string, number>).reward_margin).toBe(0);
      expect(Buffer.from(resumed!.adapter).equals(Buffer.from(unbroken!.adapter))).toBe(true);
    });

    it("when an RL job dies after saving its step, then the resumed run ends it without training again", async () => {
      const queued = await rlJob();
      const { job, events, steps } = await dieAndResume(queued.id, at("jobs.completeJob"));
      expect(steps).toEqual([
        "started",
        "g1",
        "c1",
        "started from 1 (attempt 2)",
        "training_ended",
      ]);
      expect(events[3]!.data).toEqual({
        num_sequences: 1,
        skipped_groups: 0,
        resumed_from_step: 1,
        attempt: 2,
      });
      expect(job).toMatchObject({ status: "succeeded", step_from: 0, step_to: 1 });
      expect((await db.models.get("e", job.model_id))?.latest_step).toBe(1);
    });

    it("when an RL job dies after reporting its step but before saving it, then the resumed run trains it again and keeps the first report", async () => {
      const queued = await rlJob();
      const { job, steps } = await dieAndResume(queued.id, at("models.addCheckpoint"));
      expect(steps).toEqual([
        "started",
        "g1",
        "started from 0 (attempt 2)",
        "c1",
        "training_ended",
      ]);
      expect(job).toMatchObject({ status: "succeeded", step_to: 1 });
    });
  });
}
