import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { openStore, type Store } from "@arbor/store";
import { pino } from "pino";
import { afterEach, describe, expect, it, vi } from "vitest";
import { PATIENT } from "../../../vitest.shared.ts";
import { EmbeddedWorker } from "../src/runner/embedded.ts";
import type { TrainingActivity } from "../src/runner/runner.ts";

/** The supervisor around training threads, with a stand-in thread that dies mid-job. */
const dirs: string[] = [];
afterEach(() => {
  for (const dir of dirs.splice(0)) rmSync(dir, { recursive: true, force: true });
});

async function runningJob(): Promise<{ store: Store; dataDir: string; jobId: string }> {
  const dataDir = mkdtempSync(join(tmpdir(), "arbor-supervisor-"));
  dirs.push(dataDir);
  const store = await openStore({ dataDir });
  await store.entities.ensure("e");
  const { model } = await store.models.create({
    entity: "e",
    project: "p",
    name: "m",
    base_model: "arbor/tiny-chat",
  });
  const job = await store.jobs.enqueue({ type: "rl", model_id: model.id, entity: "e" });
  await store.jobs.claimNextJob("thread-0#boot", 60_000);
  return { store, dataDir, jobId: job.id };
}

function start(
  store: Store,
  dataDir: string,
  onActivity?: (activity: TrainingActivity) => void,
  thread = "crashing-thread.ts",
) {
  return EmbeddedWorker.start({
    ...(onActivity ? { onActivity } : {}),
    store,
    logger: pino({ level: "silent" }),
    dataDir,
    logLevel: "silent",
    leaseMs: 60_000,
    maxTrainingDataBytes: 1 << 20,
    allowHosts: [],
    kernelThreads: 1,
    engineWeights: "auto",
    restartDelayMs: 50,
    threadModule: new URL(`./fixtures/${thread}`, import.meta.url),
    cancelPollMs: 100,
    stopWithinMs: 200,
  });
}

describe("EmbeddedWorker", () => {
  it("when a job is cancelled by another process while its thread computes, then the supervisor tells the thread mid-step", async () => {
    const { store, dataDir, jobId } = await runningJob();
    // Give up after about 30 s of compute: only a cancel that arrives ends it sooner.
    writeFileSync(
      join(dataDir, "compute-plan.json"),
      JSON.stringify({ workerId: "thread-0#boot", jobId, maxMicroBatches: 3000 }),
    );
    const worker = await start(store, dataDir, undefined, "computing-thread.ts");
    try {
      // Another process's cancel: a row change only, never `worker.cancelled()`.
      await vi.waitFor(() => expect(worker.running()).toEqual([jobId]), PATIENT);
      await store.jobs.cancelJob("e", jobId);
      const result = await vi.waitFor(
        () => JSON.parse(readFileSync(join(dataDir, "computed.json"), "utf8")),
        PATIENT,
      );
      expect(result.cancelled).toBe(true);
      expect(result.microBatches).toBeLessThan(3000);
    } finally {
      await worker.stop();
      await store.close();
    }
  });

  it("when a cancelled job's thread does not stop in time, then it is ended and a fresh thread starts, the job staying cancelled", async () => {
    const { store, dataDir, jobId } = await runningJob();
    writeFileSync(
      join(dataDir, "stubborn-plan.json"),
      JSON.stringify({ workerId: "thread-0#boot", jobId }),
    );
    const activity: TrainingActivity[] = [];
    const worker = await start(store, dataDir, (a) => activity.push(a), "stubborn-thread.ts");
    try {
      await vi.waitFor(() => expect(worker.running()).toEqual([jobId]), PATIENT);
      // Cancelled through the API of this process: the row, then the word, which this thread
      // never reads.
      await store.jobs.cancelJob("e", jobId);
      worker.cancelled(jobId);
      await vi.waitFor(
        () => expect(readFileSync(join(dataDir, "starts.log"), "utf8")).toBe("started\nstarted\n"),
        PATIENT,
      );
      await vi.waitFor(
        () => expect(worker.health()).toMatchObject({ success: true, running: 1 }),
        PATIENT,
      );
      expect(worker.running()).toEqual([]);
      expect(activity).toEqual([
        { type: "ended", jobType: "rl", outcome: "cancelled", seconds: expect.any(Number) },
      ]);
      const job = await store.jobs.get("e", jobId);
      expect(job?.status).toBe("cancelled");
      const events = (await store.jobs.listEvents("e", jobId)).data.map((e) => e.type);
      expect(events).toEqual(["training_failed"]);
    } finally {
      await worker.stop();
      await store.close();
    }
  });

  it("when the worker stops while a thread computes without looking (a long micro-batch), then the thread is ended and its job handed back to the queue, not counted as a crash", async () => {
    const { store, dataDir, jobId } = await runningJob();
    writeFileSync(
      join(dataDir, "stubborn-plan.json"),
      JSON.stringify({ workerId: "thread-0#boot", jobId }),
    );
    const activity: TrainingActivity[] = [];
    const worker = await start(store, dataDir, (a) => activity.push(a), "stubborn-thread.ts");
    try {
      await vi.waitFor(() => expect(worker.running()).toEqual([jobId]), PATIENT);
      await vi.waitFor(() => expect(existsSync(join(dataDir, "computing"))).toBe(true), PATIENT);
      await worker.stop();
      expect(await store.jobs.get("e", jobId)).toMatchObject({
        status: "queued",
        lease_owner: null,
        crashes: 0,
      });
      expect(activity).toEqual([]);
      // The next run claims it as any queued job, not as a reclaimed crash.
      expect(await store.jobs.reclaimOwnLeases("thread-0#", "thread-0#next")).toEqual({
        requeued: [],
        failed: [],
      });
    } finally {
      await store.close();
    }
  });

  it("when a training thread dies mid-job, then the job fails naming the cause, the health is down, and a fresh thread starts", async () => {
    const { store, dataDir, jobId } = await runningJob();
    writeFileSync(
      join(dataDir, "crash-plan.json"),
      JSON.stringify({ workerId: "thread-0#boot", jobId, crashes: 1 }),
    );
    const activity: TrainingActivity[] = [];
    const worker = await start(store, dataDir, (a) => activity.push(a));
    try {
      await vi.waitFor(async () => {
        expect((await store.jobs.get("e", jobId))?.status).toBe("failed");
      }, PATIENT);
      // The supervisor reports the dead thread's job as failed, for metrics.
      await vi.waitFor(
        () =>
          expect(activity).toEqual([
            { type: "ended", jobType: "rl", outcome: "failed", seconds: expect.any(Number) },
          ]),
        PATIENT,
      );
      const job = await store.jobs.get("e", jobId);
      expect(job?.error_message).toContain("simulated: JavaScript heap out of memory");
      const events = (await store.jobs.listEvents("e", jobId)).data;
      expect(events.map((e) => e.type)).toEqual(["training_failed"]);
      // A fresh thread loads its store and engine: on a loaded machine that takes seconds.
      await vi.waitFor(
        () =>
          expect(worker.health()).toEqual({
            success: true,
            error: null,
            threads: 1,
            running: 1,
          }),
        PATIENT,
      );
    } finally {
      await worker.stop();
      await store.close();
    }
  });

  it("when a thread keeps dying, then the health reports it restarting with the cause", async () => {
    const { store, dataDir, jobId } = await runningJob();
    writeFileSync(
      join(dataDir, "crash-plan.json"),
      JSON.stringify({ workerId: "thread-0#boot", jobId, crashes: 50 }),
    );
    const worker = await start(store, dataDir);
    try {
      await vi.waitFor(() => {
        const health = worker.health();
        expect(health.success).toBe(false);
        expect(health.error).toMatch(/training thread 0 is (restarting|starting) after: simulated/);
      }, PATIENT);
    } finally {
      await worker.stop();
      await store.close();
    }
  });
});
