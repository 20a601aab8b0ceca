import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { ArborClient } from "@arbor/client";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { PATIENT } from "../../../vitest.shared.ts";
import { followAll, leaseOwner, reversalJsonl } from "./jobs.ts";
import { dropSchema, PG_URL, pgSkipReason } from "./pg.ts";
import {
  type Child,
  leaseWorker,
  spawnLogged,
  startServerProcess,
  workerMain,
} from "./processes.ts";

/** Scale-out: an API server with no embedded worker and two worker processes on one
 * PostgreSQL queue. Every job runs exactly once; a killed worker's job is resumed by the other. */
const databaseUrl = PG_URL;
const schema = `arbor_contract_${process.pid}_${Date.now()}`;
const dataDir = mkdtempSync(join(tmpdir(), "arbor-pg-workers-"));
const children: Child[] = [];
/** The worker processes, by the id they lease jobs under. */
const workers = new Map<string, Child>();
let client: ArborClient;

const reachable = pgSkipReason === null;

const env = { DATABASE_URL: databaseUrl, ARBOR_DATABASE_SCHEMA: schema, ARBOR_DATA_DIR: dataDir };

/** Starts another worker process. */
async function spawnWorker(): Promise<void> {
  // A short lease: a killed worker's job is taken back by the other within seconds.
  const { child, entry } = await spawnLogged(
    workerMain,
    { ...env, ARBOR_WORKER_LEASE_MS: "5000" },
    "training worker started",
  );
  children.push(child);
  workers.set(String(entry.workerId), child);
}

beforeAll(async () => {
  if (!reachable) return;
  const server = await startServerProcess(dataDir, { ...env, ARBOR_EMBEDDED_WORKER: "off" });
  children.push(server.child);
  client = server.client;
  for (let i = 0; i < 2; i++) await spawnWorker();
});

afterAll(async () => {
  await Promise.all(children.map((c) => c.kill9()));
  if (reachable) {
    await dropSchema(schema, databaseUrl);
  }
  rmSync(dataDir, { recursive: true, force: true });
});

describe.skipIf(!reachable)("two workers on PostgreSQL", () => {
  it("when several jobs are queued, then each runs exactly once and ends with one terminal event", async () => {
    const dataset = await client.training.datasets.create(
      reversalJsonl(["cat", "dog", "sun", "map"]),
    );
    const jobs = [];
    for (let i = 0; i < 4; i++) {
      const model = await client.training.models.create({
        project: "scale",
        name: `m${i}`,
        base_model: "arbor/tiny-chat",
      });
      jobs.push(
        await client.training.jobs.createSft({
          model_id: model.id,
          training_data_url: dataset.url,
          config: { epochs: 2, batch_size: 2 },
        }),
      );
    }
    for (const job of jobs) {
      const events = await followAll(client, job.id);
      const types = events.map((e) => e.type);
      expect(types.filter((t) => t === "training_started")).toHaveLength(1);
      expect(types.filter((t) => t === "gradient_step")).toHaveLength(4);
      expect(types.at(-1)).toBe("training_ended");
      const done = await client.training.jobs.retrieve(job.id);
      expect(done).toMatchObject({ status: "succeeded", step_from: 0, step_to: 4 });
    }
  });

  it("when the worker running a job is killed, then the other resumes it after the lease, reporting each step once and saying where it resumed", async () => {
    const dataset = await client.training.datasets.create(
      reversalJsonl(["cat", "dog", "sun", "map", "pen", "cup", "hat", "box"]),
    );
    const model = await client.training.models.create({
      project: "scale",
      name: "killed",
      base_model: "arbor/tiny-chat",
    });
    const job = await client.training.jobs.createSft({
      model_id: model.id,
      training_data_url: dataset.url,
      config: { epochs: 12, batch_size: 2, checkpoint_every: 1 },
    });
    // Once it saved a checkpoint, kill the worker that holds it.
    await vi.waitFor(async () => {
      const { data } = await client.training.jobs.events.list(job.id, { limit: 100 });
      expect(data.some((e) => e.type === "checkpoint_saved")).toBe(true);
    }, PATIENT);
    const holder = workers.get(leaseWorker(String(await leaseOwner(databaseUrl, schema, job.id))));
    expect(holder).toBeDefined();
    await holder!.kill9();

    const events = await followAll(client, job.id);
    const types = events.map((e) => e.type);
    expect(types.filter((t) => t === "training_ended" || t === "training_failed")).toEqual([
      "training_ended",
    ]);
    expect(types.at(-1)).toBe("training_ended");
    const steps = events
      .filter((e) => e.type === "gradient_step")
      .map((e) => (e.data as { gradient_step: number }).gradient_step);
    expect(steps).toEqual(Array.from({ length: 48 }, (_, i) => i + 1));
    const starts = events
      .filter((e) => e.type === "training_started")
      .map((e) => e.data as { resumed_from_step?: number; attempt?: number });
    expect(starts).toHaveLength(2);
    expect(starts[0]).toEqual({ num_sequences: 48 });
    expect(starts[1]).toMatchObject({ num_sequences: 48, attempt: 2 });
    expect(starts[1]!.resumed_from_step).toBeGreaterThanOrEqual(1);
    const saved = events
      .filter((e) => e.type === "checkpoint_saved")
      .map((e) => (e.data as { step: number }).step);
    expect(saved).toEqual(Array.from({ length: 48 }, (_, i) => i + 1));
    expect(await client.training.jobs.retrieve(job.id)).toMatchObject({
      status: "succeeded",
      step_to: 48,
    });
  });

  it("when the worker running a job is stopped gracefully twice, as deploys do, then neither stop counts against the job: another worker resumes it at once each time and it succeeds", async () => {
    const dataset = await client.training.datasets.create(
      reversalJsonl(["cat", "dog", "sun", "map", "pen", "cup", "hat", "box"]),
    );
    const model = await client.training.models.create({
      project: "scale",
      name: "deployed",
      base_model: "arbor/tiny-chat",
    });
    const job = await client.training.jobs.createSft({
      model_id: model.id,
      training_data_url: dataset.url,
      config: { epochs: 12, batch_size: 2, checkpoint_every: 1 },
    });
    for (let stop = 1; stop <= 2; stop++) {
      // Once this run has trained a step, stop the worker that holds the job, and start another.
      let holder: Child | undefined;
      await vi.waitFor(async () => {
        const { data } = await client.training.jobs.events.list(job.id, { limit: 100 });
        expect(data.filter((e) => e.type === "training_started")).toHaveLength(stop);
        const owner = await leaseOwner(databaseUrl, schema, job.id);
        holder = owner ? workers.get(leaseWorker(owner)) : undefined;
        expect(holder).toBeDefined();
      }, PATIENT);
      expect(await holder!.terminate()).toBe(0);
      await spawnWorker();
    }
    const events = await followAll(client, job.id);
    const types = events.map((e) => e.type);
    expect(types.filter((t) => t === "training_ended" || t === "training_failed")).toEqual([
      "training_ended",
    ]);
    const steps = events
      .filter((e) => e.type === "gradient_step")
      .map((e) => (e.data as { gradient_step: number }).gradient_step);
    expect(steps).toEqual(Array.from({ length: 48 }, (_, i) => i + 1));
    const starts = events
      .filter((e) => e.type === "training_started")
      .map((e) => e.data as { attempt?: number });
    expect(starts.map((s) => s.attempt)).toEqual([undefined, 2, 3]);
    expect(await client.training.jobs.retrieve(job.id)).toMatchObject({ status: "succeeded" });
  });
});
