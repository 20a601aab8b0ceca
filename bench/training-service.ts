/**
 * The training service end to end, over HTTP: queue latency, SFT wall time, RL step time, and
 * what a second worker process buys on PostgreSQL.
 *
 * Usage: node bench/training-service.ts [--sft-repeats 2] [--rl-steps 3] [--pg-jobs 4]
 *                                        [--pg-rounds 2] [--pg-url postgres://postgres@127.0.0.1:5432/test]
 *
 * Part 1 (SQLite): the real app (`createApp`) with the embedded training worker
 * (`EmbeddedWorker`, on its own thread, as `serve()` makes it) in a child process (this
 * file with `--serve`), temp data dir, first admin key, on 127.0.0.1 port 0.
 * - Queue latency: the API's created_at has seconds resolution, so it is measured here as the
 *   arrival of the `training_started` event (`client.followTrainingJob`, opened right after the
 *   create call) minus the moment just before the create call, in ms, for every job of part 1
 *   (one at a time, so the worker is idle when each is created).
 * - SFT: 200 examples of the JSON-answer task of examples/sft-quickstart.ts (uploaded once as a
 *   dataset), LoRA rank 8, batch 8, on a fresh model each time, epochs 1 and epochs 3: wall time
 *   from before the create call to the arrival of `training_ended`, and the training part
 *   (`training_started` → `training_ended`).
 * - RL: 8 groups × 4 trajectories sampled through `POST /v1/chat/completions` (n 4, logprobs,
 *   temperature 1, the uppercase task of examples/rl-loop.ts), submitted as one training job (PPO);
 *   the step time is create → `training_ended`, with the sampling time beside it.
 *
 * Part 2 (PostgreSQL, if reachable at --pg-url): a fresh schema (dropped after), an API server
 * process without a worker (what ARBOR_EMBEDDED_WORKER=off does) and separate worker processes
 * (this file with `--work`: a `TrainingWorker` as apps/worker/src/main.ts builds it, against
 * `openStore({ databaseUrl, schema })`),
 * sharing the data dir for blobs. The same --pg-jobs SFT jobs (epochs 1, each on its own model so
 * they can run in parallel) are created at once with one worker, then with two (fresh models and
 * worker processes each time; --pg-rounds rounds, the order alternating); wall time from the
 * first create to the last `training_ended`, and the workers' CPU time (each prints it on exit). The machine has 2 cores, so 2 is the ceiling on the
 * speed-up, and less while other jobs use the machine.
 */
import type { ChildProcess } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { cpus, loadavg, tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import type { ArborClient } from "@arbor/client";
import { openStore, type StoreOptions } from "@arbor/store";
import { baseModels, sftExamplesLoader, TrainingWorker } from "@arbor/training";
import { pino } from "pino";
import {
  clientOf,
  median,
  onShutdown,
  type ServerInfo,
  sec,
  serveBench,
  startChild,
  stopChild,
  table,
  timedJob,
} from "./service-children.ts";

const SELF = fileURLToPath(import.meta.url);
const BASE = "arbor/tiny-chat";

const { values: args } = parseArgs({
  options: {
    serve: { type: "string" },
    work: { type: "string" },
    "sft-repeats": { type: "string", default: "2" },
    "rl-steps": { type: "string", default: "3" },
    "pg-jobs": { type: "string", default: "4" },
    "pg-rounds": { type: "string", default: "2" },
    "pg-url": { type: "string", default: "postgres://postgres@127.0.0.1:5432/test" },
  },
});

/** How a child opens its store (JSON in its argument). */
interface ChildSpec {
  dataDir: string;
  databaseUrl?: string;
  schema?: string;
  /** Server only: run the embedded worker. */
  worker?: boolean;
}

const storeOptions = (spec: ChildSpec): StoreOptions => ({
  dataDir: spec.dataDir,
  ...(spec.databaseUrl
    ? { databaseUrl: spec.databaseUrl, schema: spec.schema, blobDir: join(spec.dataDir, "blobs") }
    : {}),
});

const WORKER_SETTINGS = { maxTrainingDataBytes: 64 * 1024 * 1024, allowHosts: [] };

/** Child: the API server (with or without the embedded worker); prints {port, apiKey}. */
async function serve(spec: ChildSpec): Promise<void> {
  await serveBench({
    dataDir: spec.dataDir,
    databaseUrl: spec.databaseUrl,
    schema: spec.schema,
    worker: spec.worker ?? false,
  });
}

/** Child: a separate training worker process; prints {ready: true}. */
async function work(spec: ChildSpec): Promise<void> {
  const store = await openStore(storeOptions(spec));
  // What apps/worker/src/main.ts runs, with its store options.
  const worker = new TrainingWorker({
    store,
    logger: pino({ level: "error" }, pino.destination(2)),
    loadBaseModel: baseModels(),
    loadSftExamples: sftExamplesLoader(store, {
      maxBytes: WORKER_SETTINGS.maxTrainingDataBytes,
      allowHosts: WORKER_SETTINGS.allowHosts,
    }),
  });
  worker.start();
  process.stdout.write(`${JSON.stringify({ ready: true })}\n`);
  onShutdown(async () => {
    await worker.stop();
    await store.close();
    const cpu = process.cpuUsage();
    process.stdout.write(`${JSON.stringify({ cpuMs: (cpu.user + cpu.system) / 1000 })}\n`);
  });
}

/** `What is A + B? Answer in JSON.` → `{"answer": A+B}` (examples/sft-quickstart.ts). */
function sftJsonl(seed: number, count: number): string {
  let state = seed;
  const next = () => {
    state = (state * 1103515245 + 12345) % 2 ** 31;
    return state / 2 ** 31;
  };
  const lines: string[] = [];
  for (let i = 0; i < count; i++) {
    const a = Math.floor(next() * 10);
    const b = Math.floor(next() * 10);
    lines.push(
      JSON.stringify({
        messages: [
          { role: "user", content: `What is ${a} + ${b}? Answer in JSON.` },
          { role: "assistant", content: `{"answer": ${a + b}}` },
        ],
      }),
    );
  }
  return lines.join("\n");
}

async function uploadDataset(client: ArborClient, count: number): Promise<string> {
  const dataset = await client.training.datasets.create(sftJsonl(1, count), {
    name: "bench-json-answers",
  });
  if (dataset.lines !== count) throw new Error(`uploaded ${dataset.lines} lines, not ${count}`);
  return dataset.url;
}

let modelCount = 0;
async function newModel(client: ArborClient): Promise<{ id: string; alias: string }> {
  const model = await client.training.models.create({
    project: "bench",
    name: `bench-${Date.now()}-${modelCount++}`,
    base_model: BASE,
  });
  return { id: model.id, alias: `${model.entity}/${model.project}/${model.name}` };
}

/** Latencies of GET /v1/health, one after another every 20 ms, until `done` settles. */
async function healthDuring(baseUrl: string, done: Promise<unknown>): Promise<number[]> {
  let finished = false;
  done.then(
    () => {
      finished = true;
    },
    () => {
      finished = true;
    },
  );
  const latencies: number[] = [];
  while (!finished) {
    const t = performance.now();
    await (await fetch(`${baseUrl}/v1/health`)).arrayBuffer();
    latencies.push(performance.now() - t);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  return latencies;
}

function sftJob(client: ArborClient, modelId: string, datasetUrl: string, epochs: number) {
  return async () =>
    await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: datasetUrl,
      config: { epochs, batch_size: 8, learning_rate: 3e-3, lr_schedule: "cosine" },
      experimental_config: { lora_rank: 8, lora_alpha: 16, seed: 1 },
    });
}

const WORDS = ["apple", "horse", "table", "lemon", "green", "clock", "mouse", "peach"];

/** 8 groups × 4 trajectories of the uppercase task, sampled with logprobs. */
async function sampleGroups(client: ArborClient, alias: string, step: number) {
  return Promise.all(
    WORDS.map(async (word, g) => {
      const messages = [{ role: "user" as const, content: `Uppercase the word ${word}.` }];
      const sampled = await client.chat.completions.create({
        model: alias,
        messages,
        n: 4,
        max_tokens: 16,
        temperature: 1,
        logprobs: true,
        seed: step * 100 + g,
      });
      return {
        trajectories: sampled.choices.map((choice) => ({
          messages_and_choices: [...messages, choice],
          reward: (choice.message.content ?? "").trim() === word.toUpperCase() ? 1 : 0,
        })),
      };
    }),
  );
}

const load1 = () => loadavg()[0]!.toFixed(2);

async function part1(): Promise<void> {
  const dataDir = mkdtempSync(join(tmpdir(), "arbor-bench-training-"));
  const { child, info } = await startChild<ServerInfo>(SELF, "--serve", {
    dataDir,
    worker: true,
  });
  try {
    const client = clientOf(info);
    const datasetUrl = await uploadDataset(client, 200);
    const baseUrl = `http://127.0.0.1:${info.port}`;
    const queue: number[] = [];
    const queueArrival: number[] = [];
    const rows: (string | number)[][] = [];
    let health: number[] = [];
    const repeats = Number(args["sft-repeats"]);
    for (const epochs of [1, 3]) {
      const walls: number[] = [];
      const trains: number[] = [];
      for (let r = 0; r < repeats; r++) {
        const model = await newModel(client);
        const loadBefore = load1();
        const job = timedJob(client, sftJob(client, model.id, datasetUrl, epochs));
        // While the first epochs-3 job trains: does the API still answer?
        if (epochs === 3 && r === 0) health = await healthDuring(baseUrl, job);
        const t = await job;
        queue.push(t.queue);
        queueArrival.push(t.startedArrival);
        walls.push(t.endedArrival);
        trains.push(t.training);
        console.error(
          `SFT epochs ${epochs} #${r + 1}: ${sec(t.endedArrival)} s (load ${loadBefore} → ${load1()})`,
        );
      }
      rows.push([
        `SFT, 200 examples, epochs ${epochs} (${(200 / 8) * epochs} steps of 8)`,
        repeats,
        sec(median(walls)),
        sec(median(trains)),
        walls.map(sec).join(", "),
      ]);
    }
    // RL: one model, --rl-steps steps, each sampled then trained.
    const model = await newModel(client);
    const steps = Number(args["rl-steps"]);
    const sampling: number[] = [];
    const stepWalls: number[] = [];
    const stepTrains: number[] = [];
    for (let step = 0; step < steps; step++) {
      const s0 = performance.now();
      const groups = await sampleGroups(client, model.alias, step);
      sampling.push(performance.now() - s0);
      const t = await timedJob(
        client,
        async () =>
          await client.training.jobs.createRl({
            model_id: model.id,
            trajectory_groups: groups as never,
            experimental_config: { learning_rate: 1e-3, loss_fn: "ppo" },
          }),
      );
      queue.push(t.queue);
      queueArrival.push(t.startedArrival);
      stepWalls.push(t.endedArrival);
      stepTrains.push(t.training);
      console.error(
        `RL step ${step + 1}: sampling ${sec(sampling.at(-1)!)} s, step ${sec(t.endedArrival)} s`,
      );
    }
    rows.push([
      "RL step, 8 groups × 4 trajectories (PPO)",
      steps,
      sec(median(stepWalls)),
      sec(median(stepTrains)),
      stepWalls.map(sec).join(", "),
    ]);
    rows.push([
      "RL sampling of those 32 trajectories (8 requests of n 4, in parallel)",
      steps,
      sec(median(sampling)),
      "",
      sampling.map(sec).join(", "),
    ]);
    const stats = (name: string, values: number[]) => [
      name,
      values.length,
      Math.round(median(values)),
      Math.round(Math.min(...values)),
      Math.round(Math.max(...values)),
      values.map(Math.round).join(", "),
    ];
    console.log(
      `## Queue latency (SQLite, embedded worker, its default poll interval; ${queue.length} jobs created one at a time, the worker idle)\n`,
    );
    console.log(
      table(
        ["measured as", "jobs", "p50 ms", "min ms", "max ms", "each job, ms"],
        [
          stats("server clock: job id → training_started event id (UUID v7 ms)", queue),
          stats("bench: before the create call → training_started event arrives", queueArrival),
        ],
      ),
    );
    console.log(
      `\n## SFT and RL over the API (SQLite, embedded worker; wall = before the create call → training_ended arrives; training = the server's training_started → training_ended; load average now ${load1()})\n`,
    );
    console.log(
      table(["job", "runs", "wall s (median)", "training s (median)", "each run, wall s"], rows),
    );
    console.log(
      `\nGET /v1/health while an epochs-3 SFT job trains in the embedded worker: ${health.length} requests, p50 ${median(health).toFixed(1)} ms, max ${Math.max(...health).toFixed(0)} ms.`,
    );
  } finally {
    await stopChild(child);
    rmSync(dataDir, { recursive: true, force: true });
  }
}

async function part2(): Promise<void> {
  const databaseUrl = args["pg-url"];
  const schema = `arbor_bench_${randomBytes(4).toString("hex")}`;
  const dataDir = mkdtempSync(join(tmpdir(), "arbor-bench-training-pg-"));
  let admin: Awaited<ReturnType<typeof openStore>>;
  try {
    admin = await openStore({ dataDir, databaseUrl, schema, blobDir: join(dataDir, "blobs") });
  } catch (err) {
    console.log(
      `\n## Workers on PostgreSQL: skipped (${databaseUrl} not reachable: ${(err as Error).message})`,
    );
    rmSync(dataDir, { recursive: true, force: true });
    return;
  }
  const spec: ChildSpec = { dataDir, databaseUrl, schema };
  const children: ChildProcess[] = [];
  try {
    const server = await startChild<ServerInfo>(SELF, "--serve", spec);
    children.push(server.child);
    const client = clientOf(server.info);
    const datasetUrl = await uploadDataset(client, 200);
    const jobs = Number(args["pg-jobs"]);
    const rows: (string | number)[][] = [];
    const rounds = Number(args["pg-rounds"]);
    const walls: Record<number, number[]> = { 1: [], 2: [] };
    for (let round = 0; round < rounds; round++) {
      for (const workers of round % 2 ? [2, 1] : [1, 2]) {
        const models = [];
        for (let i = 0; i < jobs; i++) models.push(await newModel(client));
        const started = [];
        for (let i = 0; i < workers; i++)
          started.push(await startChild<{ ready: boolean }>(SELF, "--work", spec));
        const loadBefore = load1();
        const t0 = performance.now();
        const times = await Promise.all(
          models.map((model) => timedJob(client, sftJob(client, model.id, datasetUrl, 1))),
        );
        const wall = performance.now() - t0;
        let cpuMs = 0;
        for (const w of started) {
          await stopChild(w.child);
          cpuMs += (JSON.parse(w.lines.at(-1)!) as { cpuMs: number }).cpuMs;
        }
        walls[workers]!.push(wall);
        const paired = walls[workers === 1 ? 2 : 1]![round];
        console.error(`round ${round + 1}, ${workers} worker(s): ${sec(wall)} s`);
        rows.push([
          round + 1,
          workers,
          jobs,
          sec(wall),
          sec(median(times.map((t) => t.endedArrival))),
          Math.round(median(times.map((t) => t.queue))),
          sec(median(times.map((t) => t.training))),
          sec(cpuMs),
          `${loadBefore} → ${load1()}`,
          // The round's speed-up, on the row of whichever ran second.
          paired === undefined
            ? ""
            : `${(workers === 2 ? paired / wall : wall / paired).toFixed(2)}×`,
        ]);
      }
    }
    console.log(
      `\n## Workers on PostgreSQL (${jobs} SFT jobs, 200 examples, epochs 1, each on its own model, created at once; API server without a worker; at most 2× here: 2 cores)\n`,
    );
    console.log(
      table(
        [
          "round",
          "worker processes",
          "jobs",
          "wall s (first create → last ended)",
          "job wall s (median)",
          "queue ms (median)",
          "training s (median)",
          "workers' CPU s",
          "load avg (1 min)",
          "round's speed-up",
        ],
        rows,
      ),
    );
    const one = median(walls[1]!);
    const two = median(walls[2]!);
    const perRound = walls[1]!.map((w, i) => w / walls[2]![i]!);
    console.log(
      `\nMedian wall time: 1 worker ${sec(one)} s, 2 workers ${sec(two)} s: ${(one / two).toFixed(2)}×; per round ${perRound.map((r) => `${r.toFixed(2)}×`).join(", ")}, median ${median(perRound).toFixed(2)}× (at most 2× on this 2-core machine, and only if nothing else runs).`,
    );
  } finally {
    for (const child of children) await stopChild(child);
    await admin.sql.exec(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
    await admin.close();
    rmSync(dataDir, { recursive: true, force: true });
  }
}

if (args.serve) await serve(JSON.parse(args.serve) as ChildSpec);
else if (args.work) await work(JSON.parse(args.work) as ChildSpec);
else {
  console.log(
    `# training-service: ${new Date().toISOString()}, Node ${process.version}, ${cpus().length} × ${cpus()[0]?.model ?? "?"}, load average (1/5/15 min) ${loadavg()
      .map((l) => l.toFixed(2))
      .join(" / ")}\n`,
  );
  await part1();
  await part2();
}
