import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, readdirSync, rmSync, utimesSync, watch } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import * as remote from "@arbor/cli/remote";
import { type ArborClient, type TrainingJobEvent, unwrap } from "@arbor/client";
import { adapterToFiles, catalogModelDir, createLoraAdapter, loadModel } from "@arbor/engine/model";
import tar from "tar-stream";
import { afterAll, describe, expect, it, vi } from "vitest";
import { PATIENT } from "../../../vitest.shared.ts";
import { followAll, reversalJsonl } from "./jobs.ts";
import { type Child, startServerProcess } from "./processes.ts";

/** The real server as a child process, killed with SIGKILL mid-job and started again. */
const dataDir = mkdtempSync(join(tmpdir(), "arbor-faults-"));
let child: Child | undefined;

async function startChild(): Promise<ArborClient> {
  // A lease far longer than the test may run: a job is resumed after the restart only because
  // the restarted server reclaims its own previous run's leases at once.
  const started = await startServerProcess(dataDir, { ARBOR_WORKER_LEASE_MS: "600000" });
  child = started.child;
  return started.client;
}

const kill9 = () => child!.kill9();

afterAll(async () => {
  await child?.kill9();
  rmSync(dataDir, { recursive: true, force: true });
});

const jsonl = reversalJsonl(["cat", "dog", "sun", "map", "pen", "cup", "hat", "box"]);

describe("kill -9 during a job", () => {
  it("when the server dies mid-job and restarts, then the job resumes from its checkpoint to one terminal event, reports each step once, no partial checkpoint is listed, and the queue goes on", async () => {
    let client = await startChild();
    const model = await client.training.models.create({
      project: "faults",
      name: "victim",
      base_model: "arbor/tiny-chat",
    });
    const dataset = await client.training.datasets.create(jsonl);
    const body = {
      model_id: model.id,
      training_data_url: dataset.url,
      config: { epochs: 12, batch_size: 2, checkpoint_every: 1 },
    };
    const job = unwrap(await client.POST("/v1/preview/sft-training-jobs", { body }));
    const next = await client.training.jobs.createSft({
      ...body,
      config: { epochs: 1, batch_size: 4 },
    });

    // Wait until the first job has saved a checkpoint, then kill the process.
    await vi.waitFor(async () => {
      const { data } = await client.training.jobs.events.list(job.id, { limit: 100 });
      expect(data.some((e) => e.type === "checkpoint_saved")).toBe(true);
    }, PATIENT);
    await kill9();

    client = await startChild();
    const followed = new Map<string, TrainingJobEvent[]>();
    for (const id of [job.id, next.id]) {
      const events = await followAll(client, id);
      followed.set(id, events);
      const terminal = events.filter(
        (e) => e.type === "training_ended" || e.type === "training_failed",
      );
      expect(terminal).toHaveLength(1);
      expect(events.at(-1)).toEqual(terminal[0]);
      // Each step reported once, in order, though the resumed run trained some of them again.
      const steps = events
        .filter((e) => e.type === "gradient_step")
        .map((e) => (e.data as { gradient_step: number }).gradient_step);
      const total = (events[0]!.data as { num_sequences: number }).num_sequences;
      expect(steps).toEqual(Array.from({ length: total }, (_, i) => i + 1));
      const saved = events
        .filter((e) => e.type === "checkpoint_saved")
        .map((e) => (e.data as { step: number }).step);
      expect(new Set(saved).size).toBe(saved.length);
    }
    // The killed job says where it went on: after a checkpoint saved before the kill, so not
    // from the start; its next run is its second. The queued one just started.
    const starts = (id: string) =>
      followed
        .get(id)!
        .filter((e) => e.type === "training_started")
        .map((e) => e.data as { resumed_from_step?: number; attempt?: number });
    const [, resumed] = starts(job.id);
    expect(starts(job.id)).toHaveLength(2);
    expect(starts(job.id)[0]!.resumed_from_step).toBeUndefined();
    expect(resumed).toMatchObject({ resumed_from_step: expect.any(Number), attempt: 2 });
    expect(resumed!.resumed_from_step).toBeGreaterThanOrEqual(1);
    expect(starts(next.id)).toEqual([{ num_sequences: 2 }]);
    // `arbor jobs follow` on the killed job.
    const said: string[] = [];
    await remote.followJob(client, { job: job.id }, { line: (t) => said.push(t), bar: () => {} });
    expect(said[0]).toBe("Training started: 48 steps.");
    expect(said).toContain(`Resumed from step ${resumed!.resumed_from_step} of 48 (attempt 2).`);
    expect(said.at(-1)).toBe("Training ended.");
    const [first, second] = await Promise.all(
      [job.id, next.id].map(async (id) => await client.training.jobs.retrieve(id)),
    );
    expect(first!.status).toBe("succeeded");
    expect(second!.status).toBe("succeeded");

    // Every listed checkpoint serves: none points at missing or partial files.
    const { data } = await client.training.models.checkpoints.list(model.id, { limit: 100 });
    for (const checkpoint of data) {
      const chat = await client.POST("/v1/chat/completions", {
        body: {
          model: checkpoint.model,
          messages: [{ role: "user", content: "Reverse the word cat." }],
          max_tokens: 4,
        },
      });
      expect(chat.response.status).toBe(200);
    }
    await kill9();
  });
});

/** A job's events so far, every page. */
async function eventsSoFar(client: ArborClient, jobId: string): Promise<TrainingJobEvent[]> {
  const events: TrainingJobEvent[] = [];
  for (let after: string | undefined; ; ) {
    const page = await client.training.jobs.events.list(jobId, {
      limit: 100,
      ...(after ? { after } : {}),
    });
    events.push(...page.data);
    if (!page.has_more) return events;
    after = page.data.at(-1)!.id;
  }
}

/** Runs the dying writer over `dataDir` and kills it with SIGKILL once its last write began. */
function killMidWrite(dataDir: string, keys: string[]): Promise<void> {
  const writer = fileURLToPath(new URL("./fixtures/dying-writer.ts", import.meta.url));
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [writer, dataDir, ...keys], {
      stdio: ["ignore", "pipe", "pipe"],
    });
    child.stdout.on("data", (d: Buffer) => {
      if (d.toString().includes("writing")) child.kill("SIGKILL");
    });
    child.on("exit", (_code, signal) =>
      signal === "SIGKILL" ? resolve() : reject(new Error("the writer was not killed mid-write")),
    );
  });
}

/** Every file under the data directory's blobs, as relative paths. */
function blobFiles(dataDir: string): string[] {
  const root = join(dataDir, "blobs");
  if (!existsSync(root)) return [];
  return (readdirSync(root, { recursive: true, withFileTypes: true }) as import("node:fs").Dirent[])
    .filter((e) => e.isFile())
    .map((e) => join(e.parentPath, e.name).slice(root.length + 1));
}

describe("SIGTERM during a job", () => {
  it("when the server is stopped gracefully twice during one job, as deploys do, then neither stop counts against the job: it resumes each time and succeeds, each step reported once", async () => {
    let client = await startChild();
    const model = await client.training.models.create({
      project: "faults",
      name: "deployed",
      base_model: "arbor/tiny-chat",
    });
    const dataset = await client.training.datasets.create(jsonl);
    const job = await client.training.jobs.createSft({
      model_id: model.id,
      training_data_url: dataset.url,
      config: { epochs: 12, batch_size: 2, checkpoint_every: 1 },
    });
    // Twice (the restart budget of crashes), each time once the run has saved a checkpoint.
    for (let stop = 1; stop <= 2; stop++) {
      await vi.waitFor(async () => {
        const data = await eventsSoFar(client, job.id);
        const runs = data.filter((e) => e.type === "training_started");
        expect(runs).toHaveLength(stop);
        const last = data.lastIndexOf(runs.at(-1)!);
        expect(data.slice(last).some((e) => e.type === "checkpoint_saved")).toBe(true);
      }, PATIENT);
      expect(await child!.terminate()).toBe(0);
      client = await startChild();
    }
    const events = await followAll(client, job.id);
    expect(events.filter((e) => e.type === "training_failed")).toEqual([]);
    expect(events.at(-1)!.type).toBe("training_ended");
    const steps = events
      .filter((e) => e.type === "gradient_step")
      .map((e) => (e.data as { gradient_step: number }).gradient_step);
    expect(steps).toEqual(Array.from({ length: 48 }, (_, i) => i + 1));
    const starts = events
      .filter((e) => e.type === "training_started")
      .map((e) => e.data as { resumed_from_step?: number; attempt?: number });
    expect(starts.map((s) => s.attempt)).toEqual([undefined, 2, 3]);
    expect(await client.training.jobs.retrieve(job.id)).toMatchObject({ status: "succeeded" });
    await kill9();
  });
});

describe("kill -9 during writes", () => {
  it("when a checkpoint save and an upload were cut off, then a restarted server removes their partial files and the unnamed checkpoint folder, and deleting the model removes all its files", async () => {
    let client = await startChild();
    const model = await client.training.models.create({
      project: "faults",
      name: "cut-off",
      base_model: "arbor/tiny-chat",
    });
    await kill9();
    const folder = `checkpoints/${model.id}/7-0193a0b3-f0e1-7d2c-ab3c-4d5e6f708192`;
    await killMidWrite(dataDir, [
      `${folder}/adapter_config.json`,
      `${folder}/adapter_model.safetensors`,
    ]);
    await killMidWrite(dataDir, ["datasets/0193a0b3-f0e1-7d2c-ab3c-000000000001.jsonl"]);
    expect(blobFiles(dataDir).filter((f) => f.includes(".tmp-"))).toHaveLength(2);
    // Written two minutes before the restart: past the minute an upload's row may take.
    const before = new Date(Date.now() - 2 * 60_000);
    for (const file of blobFiles(dataDir).filter((f) => f.startsWith(folder)))
      utimesSync(join(dataDir, "blobs", file), before, before);

    client = await startChild();
    const left = blobFiles(dataDir);
    expect(left.filter((f) => f.includes(".tmp-"))).toEqual([]);
    expect(left.filter((f) => f.startsWith(folder))).toEqual([]);

    // A model's own files (a written checkpoint) go with it, named by a row or not.
    await killMidWrite(dataDir, [
      `checkpoints/${model.id}/8-x/adapter_config.json`,
      "datasets/x.tmp",
    ]);
    await client.training.models.delete(model.id);
    expect(blobFiles(dataDir).filter((f) => f.startsWith(`checkpoints/${model.id}`))).toEqual([]);
    await kill9();
  });
});

describe("kill -9 during a GGUF export", () => {
  it("when the server dies while building a checkpoint's first GGUF, then a restarted server removes the export folder from the temp directory, and the download then works and leaves none", async () => {
    const home = mkdtempSync(join(tmpdir(), "arbor-faults-export-"));
    const temp = mkdtempSync(join(tmpdir(), "arbor-faults-tmpdir-"));
    const exportFolders = () => readdirSync(temp).filter((n) => n.startsWith("arbor-export-"));
    let server: Child | undefined;
    try {
      const start = async () => {
        const started = await startServerProcess(home, { TMPDIR: temp });
        server = started.child;
        return started;
      };
      let { client, apiKey, port } = await start();
      const model = await client.training.models.create({
        project: "faults",
        name: "exported",
        base_model: "arbor/tiny-chat",
      });
      const base = await loadModel(catalogModelDir("arbor/tiny-chat"));
      const adapter = await tarOf(
        adapterToFiles(createLoraAdapter(base, { baseModel: "arbor/tiny-chat" })),
      );
      const gguf = (step: number) =>
        fetch(
          `http://127.0.0.1:${port}/v1/preview/models/${model.id}/checkpoints/${step}/content?format=gguf`,
          { headers: { authorization: `Bearer ${apiKey}` } },
        );
      // The export's folder lives from its build's start to its end: the kill lands inside
      // that window once the folder appears (a new checkpoint, so a first export, each try).
      for (let step = 1; exportFolders().length === 0; step++) {
        expect(step, "the server was never killed mid-export").toBeLessThanOrEqual(10);
        const uploaded = await fetch(
          `http://127.0.0.1:${port}/v1/preview/models/${model.id}/checkpoints`,
          {
            method: "POST",
            headers: { authorization: `Bearer ${apiKey}`, "content-type": "application/x-tar" },
            body: adapter,
          },
        );
        expect(uploaded.status).toBe(200);
        const watcher = watch(temp, (_event, name) => {
          if (name?.startsWith("arbor-export-")) void server!.kill9();
        });
        await gguf(step)
          .then((r) => r.arrayBuffer())
          .catch(() => undefined);
        await server!.kill9();
        watcher.close();
        if (exportFolders().length === 0) ({ client, apiKey, port } = await start());
      }

      // Swept before the restarted server says it listens: its writer no longer runs.
      ({ client, apiKey, port } = await start());
      expect(exportFolders()).toEqual([]);
      const { data } = await client.training.models.checkpoints.list(model.id, { order: "desc" });
      const response = await gguf(data[0]!.step);
      expect(response.status).toBe(200);
      expect((await response.arrayBuffer()).byteLength).toBeGreaterThan(0);
      expect(exportFolders()).toEqual([]);
    } finally {
      await server?.kill9();
      rmSync(home, { recursive: true, force: true });
      rmSync(temp, { recursive: true, force: true });
    }
  });
});

async function tarOf(files: Record<string, Uint8Array>): Promise<Buffer> {
  const pack = tar.pack();
  for (const [name, body] of Object.entries(files)) pack.entry({ name }, Buffer.from(body));
  pack.finalize();
  const chunks: Buffer[] = [];
  for await (const chunk of pack) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks);
}
