import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { ArborClient, TrainingJobEvent } from "@arbor/client";
import pg from "pg";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { PG_URL, pgSkipReason } from "./pg.ts";
import { type Child, spawnLogged, startServerProcess, workerMain } from "./processes.ts";

/** Scale-out: an API server with no embedded worker and two worker processes on one
 * PostgreSQL queue. Every job runs exactly once. */
const databaseUrl = PG_URL;
const schema = `arbor_contract_${process.pid}_${Date.now()}`;
const dataDir = mkdtempSync(join(tmpdir(), "arbor-pg-workers-"));
const children: Child[] = [];
let client: ArborClient;

const reachable = pgSkipReason === null;

beforeAll(async () => {
  if (!reachable) return;
  const env = { DATABASE_URL: databaseUrl, ARBOR_DATABASE_SCHEMA: schema, ARBOR_DATA_DIR: dataDir };
  const server = await startServerProcess(dataDir, { ...env, ARBOR_EMBEDDED_WORKER: "off" });
  children.push(server.child);
  client = server.client;
  for (let i = 0; i < 2; i++)
    children.push((await spawnLogged(workerMain, env, "training worker started")).child);
});

afterAll(async () => {
  await Promise.all(children.map((c) => c.kill9()));
  if (reachable) {
    const c = new pg.Client({ connectionString: databaseUrl });
    await c.connect();
    await c.query(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
    await c.end();
  }
  rmSync(dataDir, { recursive: true, force: true });
});

describe.skipIf(!reachable)("two workers on PostgreSQL", () => {
  it("when several jobs are queued, then each runs exactly once and ends with one terminal event", async () => {
    const line = (w: string) =>
      JSON.stringify({
        messages: [
          { role: "user", content: `Reverse ${w}.` },
          { role: "assistant", content: [...w].reverse().join("") },
        ],
      });
    const dataset = await client.training.datasets.create(
      ["cat", "dog", "sun", "map"].map(line).join("\n"),
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
      const events: TrainingJobEvent[] = [];
      for await (const event of client.training.jobs.events.follow(job.id)) events.push(event);
      const types = events.map((e) => e.type);
      expect(types.filter((t) => t === "training_started")).toHaveLength(1);
      expect(types.filter((t) => t === "gradient_step")).toHaveLength(4);
      expect(types.at(-1)).toBe("training_ended");
      const done = await client.training.jobs.retrieve(job.id);
      expect(done).toMatchObject({ status: "succeeded", step_from: 0, step_to: 4 });
    }
  }, 180_000);
});
