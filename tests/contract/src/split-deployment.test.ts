import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type ArborClient, createArborClient, RateLimitError } from "@arbor/client";
import pg from "pg";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { PATIENT } from "../../../vitest.shared.ts";
import { followAll, leaseOwner, reversalJsonl } from "./jobs.ts";
import { PG_URL, pgSkipReason } from "./pg.ts";
import {
  type Child,
  leaseWorker,
  spawnLogged,
  startServerProcess,
  workerMain,
} from "./processes.ts";

/**
 * A split deployment on one PostgreSQL schema (ADR 39–43): a `training` role, two `inference`
 * replicas, a `calls` role and two worker processes, each with its own data directory and port,
 * so they share only what they share through the database.
 */
const reachable = pgSkipReason === null;
const schema = `arbor_split_${process.pid}_${Date.now()}`;
const dirs: string[] = [];
const children: Child[] = [];
/** Requests a minute per project on the inference replicas, which must hold across both. */
const PROJECT_RPM = 4;
const LEASE_MS = 3000;

let training: ArborClient;
let inference: [ArborClient, ArborClient];
let calls: ArborClient;
let apiKey: string;
let ports: { training: number; inference: [number, number]; calls: number };
const workers = new Map<string, Child>();
let db: pg.Client;

const dir = (name: string) => {
  const path = mkdtempSync(join(tmpdir(), `arbor-split-${name}-`));
  dirs.push(path);
  return path;
};

beforeAll(async () => {
  if (!reachable) return;
  const shared = {
    DATABASE_URL: PG_URL,
    ARBOR_DATABASE_SCHEMA: schema,
    ARBOR_PROJECT_RPM: String(PROJECT_RPM),
  };
  const first = await startServerProcess(dir("training"), {
    ...shared,
    ARBOR_ROLES: "training",
    ARBOR_EMBEDDED_WORKER: "off",
  });
  children.push(first.child);
  training = first.client;
  apiKey = first.apiKey;
  const role = async (roles: string, name: string) => {
    const started = await startServerProcess(dir(name), { ...shared, ARBOR_ROLES: roles }, apiKey);
    children.push(started.child);
    return started;
  };
  const [a, b, c] = await Promise.all([
    role("inference", "inference-a"),
    role("inference", "inference-b"),
    role("calls", "calls"),
  ]);
  inference = [a.client, b.client];
  calls = c.client;
  ports = { training: first.port, inference: [a.port, b.port], calls: c.port };
  for (const id of ["worker-1", "worker-2"]) {
    const { child } = await spawnLogged(
      workerMain,
      {
        ...shared,
        ARBOR_DATA_DIR: dir(id),
        ARBOR_WORKER_ID: id,
        ARBOR_WORKER_LEASE_MS: String(LEASE_MS),
      },
      "training worker started",
    );
    children.push(child);
    workers.set(id, child);
  }
  db = new pg.Client({ connectionString: PG_URL });
  await db.connect();
});

afterAll(async () => {
  await Promise.all(children.map((c) => c.kill9()));
  if (reachable) {
    await db?.query(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
    await db?.end();
  }
  for (const path of dirs) rmSync(path, { recursive: true, force: true });
});

const TERMINAL = new Set(["training_ended", "training_failed", "training_cancelled"]);

describe.skipIf(!reachable)("a split deployment on one PostgreSQL schema", () => {
  let checkpoint: string;

  it("when an SFT job is created on the training role, then a worker trains it and both inference replicas serve its checkpoint", async () => {
    const dataset = await training.training.datasets.create(
      reversalJsonl(["cat", "dog", "sun", "map"]),
    );
    const model = await training.training.models.create({
      project: "split",
      name: "reverse",
      base_model: "arbor/tiny-chat",
    });
    const job = await training.training.jobs.createSft({
      model_id: model.id,
      training_data_url: dataset.url,
      config: { epochs: 2, batch_size: 2 },
    });
    const events = await followAll(training, job.id);
    expect(events.at(-1)).toMatchObject({ type: "training_ended" });
    // No process but the two workers can train: the training role runs no embedded worker.
    expect(trainedBy(job.id)).toHaveLength(1);
    checkpoint = `default/split/reverse:step4`;
    const answers = [];
    for (const replica of inference) {
      const completion = await replica.chat.completions.create({
        model: checkpoint,
        messages: [{ role: "user", content: "Reverse the word cat." }],
        max_tokens: 8,
        temperature: 0,
      });
      expect(completion.model).toBe(checkpoint);
      answers.push(completion.choices[0]!.message.content);
    }
    expect(answers[1]).toBe(answers[0]);
    // The alias resolves to the latest checkpoint on either replica.
    for (const replica of inference) {
      const completion = await replica.chat.completions.create({
        model: "default/split/reverse",
        messages: [{ role: "user", content: "Reverse the word cat." }],
        max_tokens: 8,
        temperature: 0,
      });
      expect(completion.model).toBe(checkpoint);
      expect(completion.choices[0]!.message.content).toBe(answers[0]);
    }
  });

  it("when chats on both inference replicas name a trace, then the calls role sums their usage", async () => {
    const project = "default/split-usage";
    await calls.calls.start({
      start: {
        project_id: project,
        id: "split-run",
        trace_id: "split-trace",
        op_name: "agent",
        started_at: new Date().toISOString(),
      },
    });
    const headers = { "Arbor-Trace-Id": "split-trace", "Arbor-Parent-Call-Id": "split-run" };
    const usages: { prompt_tokens: number; completion_tokens: number }[] = [];
    for (const port of ports.inference) {
      const replica = createReplicaClient(port, { project, headers });
      const completion = await replica.chat.completions.create({
        model: "arbor/tiny-chat",
        messages: [{ role: "user", content: "Hi" }],
        max_tokens: 4,
      });
      usages.push(completion.usage!);
    }
    const usage = await calls.calls.usage({ project_id: project, call_ids: ["split-run"] });
    const sum = (key: "prompt_tokens" | "completion_tokens") =>
      usages.reduce((n, usage) => n + usage[key], 0);
    expect(usage.call_usage["split-run"]).toEqual({
      "arbor/tiny-chat": expect.objectContaining({
        requests: 2,
        prompt_tokens: sum("prompt_tokens"),
        completion_tokens: sum("completion_tokens"),
      }),
    });
  });

  it("when a project sends more than its requests a minute across both replicas, then the excess is refused", async () => {
    const outcomes: string[] = [];
    const clients = ports.inference.map((port) =>
      createReplicaClient(port, { project: "default/split-limited" }),
    );
    // Twice the limit, alternating: replicas that each kept their own count would serve all.
    for (let i = 0; i < PROJECT_RPM * 2; i++) {
      try {
        await clients[i % 2]!.chat.completions.create({
          model: "arbor/tiny-chat",
          messages: [{ role: "user", content: "Hi" }],
          max_tokens: 1,
        });
        outcomes.push("ok");
      } catch (err) {
        if (!(err instanceof RateLimitError)) throw err;
        outcomes.push("429");
      }
    }
    const served = outcomes.filter((o) => o === "ok").length;
    // The bucket refills one request every 60/RPM s: at most one more may be served meanwhile.
    expect(served).toBeGreaterThanOrEqual(PROJECT_RPM);
    expect(served).toBeLessThanOrEqual(PROJECT_RPM + 1);
    expect(outcomes.slice(0, PROJECT_RPM)).toEqual(Array(PROJECT_RPM).fill("ok"));
  });

  it("when the worker holding a job is killed, then the other finishes it after the lease, with one terminal event", async () => {
    const words = Array.from({ length: 64 }, (_, i) => `w${i.toString(36)}x${(i * 7) % 10}`);
    const dataset = await training.training.datasets.create(reversalJsonl(words));
    const model = await training.training.models.create({
      project: "split",
      name: "survivor",
      base_model: "arbor/tiny-chat",
    });
    const job = await training.training.jobs.createSft({
      model_id: model.id,
      training_data_url: dataset.url,
      config: { epochs: 4, batch_size: 2 },
    });
    // Wait for the first step, then kill whichever worker holds the lease.
    await vi.waitFor(async () => {
      const { data } = await training.training.jobs.events.list(job.id);
      expect(data.some((e) => e.type === "gradient_step")).toBe(true);
    }, PATIENT);
    const owner = await leaseOwner(PG_URL, schema, job.id);
    expect(owner).not.toBeNull();
    await workers.get(leaseWorker(owner!))!.kill9();
    const events = await followAll(training, job.id);
    expect(events.filter((e) => TERMINAL.has(e.type))).toHaveLength(1);
    expect(events.at(-1)?.type).toBe("training_ended");
    const done = await training.training.jobs.retrieve(job.id);
    expect(done.status).toBe("succeeded");
    // Both workers ran it: the first until killed, the other to its end.
    expect(trainedBy(job.id).sort()).toEqual(["worker-1", "worker-2"]);
    // The other worker resumed it, said so, and reported no step twice (ADR 41).
    const steps = events.filter((e) => e.type === "gradient_step").map((e) => e.data.gradient_step);
    expect(new Set(steps).size).toBe(steps.length);
    expect(events.filter((e) => e.type === "training_started").at(-1)?.data).toMatchObject({
      resumed_from_step: expect.any(Number),
      attempt: 2,
    });
  });

  it("when each role is asked for its system check, then it reports its own dependencies", async () => {
    const check = (port: number) => createReplicaClient(port).health.systemCheck();
    const trainingCheck = await check(ports.training);
    expect(trainingCheck).toMatchObject({ roles: ["training"], database: { success: true } });
    expect(trainingCheck.queue).toMatchObject({ success: true });
    expect(trainingCheck.engine).toMatchObject({ success: true });
    expect(trainingCheck.worker).toBeUndefined();
    for (const port of ports.inference) {
      const inferenceCheck = await check(port);
      expect(inferenceCheck).toMatchObject({ roles: ["inference"], engine: { success: true } });
      expect(inferenceCheck.queue).toBeUndefined();
      expect(inferenceCheck.worker).toBeUndefined();
    }
    const callsCheck = await check(ports.calls);
    expect(callsCheck).toMatchObject({ roles: ["calls"], database: { success: true } });
    expect(callsCheck.queue).toBeUndefined();
    expect(callsCheck.engine).toBeUndefined();
  });
});

/** The workers whose threads logged starting a run of `jobId`. */
function trainedBy(jobId: string): string[] {
  return [...workers]
    .filter(([, child]) =>
      child.logs.some((log) => log.jobId === jobId && log.msg === "training job started"),
    )
    .map(([id]) => id);
}

function createReplicaClient(
  port: number,
  options: { project?: string; headers?: Record<string, string> } = {},
): ArborClient {
  return createArborClient({
    baseUrl: `http://127.0.0.1:${port}`,
    apiKey,
    maxRetries: 0,
    ...options,
  });
}
