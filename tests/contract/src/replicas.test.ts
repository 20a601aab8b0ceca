import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type ArborClient, createArborClient } from "@arbor/client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { followAll, reversalJsonl } from "./jobs.ts";
import { dropSchema, PG_URL, pgSkipReason } from "./pg.ts";
import { type Child, startServerProcess } from "./processes.ts";

/**
 * Two server processes on one PostgreSQL schema, each with a data directory of its own (two
 * machines): what one stores, the other serves. Replica A runs no worker, so B's embedded worker
 * trains, on a dataset uploaded to A; checkpoints are chatted with and downloaded on A. Neither
 * data directory ever holds a blob: checkpoints and datasets are in the database (ADR 39). A
 * project's requests per minute hold across both replicas together.
 */
const schema = `arbor_replicas_${process.pid}_${Date.now()}`;
const dirs = [0, 1].map((i) => mkdtempSync(join(tmpdir(), `arbor-replica-${i}-`)));
const children: Child[] = [];
let a: ArborClient;
let b: ArborClient;
let apiKey: string;
/** The replicas' base URLs. */
const urls: string[] = [];
const RPM = 4;

const reachable = pgSkipReason === null;

beforeAll(async () => {
  if (!reachable) return;
  const env = {
    DATABASE_URL: PG_URL,
    ARBOR_DATABASE_SCHEMA: schema,
    ARBOR_PROJECT_RPM: String(RPM),
  };
  const first = await startServerProcess(dirs[0]!, { ...env, ARBOR_EMBEDDED_WORKER: "off" });
  children.push(first.child);
  a = first.client;
  urls.push(`http://127.0.0.1:${first.port}`);
  // The first start made the admin in the shared database and wrote its key in A's directory.
  apiKey = first.apiKey;
  const second = await startServerProcess(dirs[1]!, env, apiKey);
  children.push(second.child);
  b = second.client;
  urls.push(`http://127.0.0.1:${second.port}`);
});

afterAll(async () => {
  await Promise.all(children.map((c) => c.kill9()));
  if (reachable) {
    await dropSchema(schema);
  }
  for (const dir of dirs) rmSync(dir, { recursive: true, force: true });
});

async function bytesOf(body: ReadableStream<Uint8Array>): Promise<Buffer> {
  const parts: Buffer[] = [];
  for await (const part of body) parts.push(Buffer.from(part));
  return Buffer.concat(parts);
}

describe.skipIf(!reachable)("two replicas with separate data directories", () => {
  it("when a dataset is uploaded to one, then the other trains on it, and its checkpoints are served and downloaded by either", async () => {
    const lines = reversalJsonl(["cat", "dog", "sun", "map", "cup", "pen"]).split("\n");
    const dataset = await a.training.datasets.create(lines.join("\n"), { name: "words" });
    // B reads A's upload back, line by line.
    const read = await b.training.datasets.lines(dataset.id);
    expect(read.data.map((l) => l.example)).toEqual(lines.map((l) => JSON.parse(l)));

    const model = await a.training.models.create({
      project: "replicas",
      name: "reverser",
      base_model: "arbor/tiny-chat",
    });
    const job = await a.training.jobs.createSft({
      model_id: model.id,
      training_data_url: dataset.url,
      config: { epochs: 2, batch_size: 3, checkpoint_every: 2 },
    });
    const events = await followAll(a, job.id);
    expect(events.at(-1)?.type).toBe("training_ended");
    expect(await a.training.jobs.retrieve(job.id)).toMatchObject({
      status: "succeeded",
      step_to: 4,
    });

    // A never trained (no worker) and never had the files: it loads B's adapter from the
    // database to answer.
    const answer = await a.chat.completions.create({
      model: "default/replicas/reverser:step4",
      messages: [{ role: "user", content: "Reverse the word cat." }],
      max_tokens: 4,
      temperature: 0,
    });
    expect(answer.model).toBe("default/replicas/reverser:step4");
    const onB = await b.chat.completions.create({
      model: "default/replicas/reverser:step4",
      messages: [{ role: "user", content: "Reverse the word cat." }],
      max_tokens: 4,
      temperature: 0,
    });
    expect(onB.choices[0]!.message.content).toBe(answer.choices[0]!.message.content);

    // PEFT's files as a tar, from either replica: the same bytes, the digest they announce.
    const fromA = await a.training.models.checkpoints.download(model.id, 2);
    const fromB = await b.training.models.checkpoints.download(model.id, 2);
    const [tarA, tarB] = [await bytesOf(fromA.body), await bytesOf(fromB.body)];
    expect(tarA.length).toBe(fromA.bytes);
    expect(tarA.equals(tarB)).toBe(true);
    expect(fromA.digest).toBe(fromB.digest);
    // A GGUF built on A (and kept beside the checkpoint) is the one B serves.
    const ggufA = await a.training.models.checkpoints.download(model.id, 4, {
      format: "gguf",
    });
    const ggufBytes = await bytesOf(ggufA.body);
    expect(ggufBytes.subarray(0, 4).toString("latin1")).toBe("GGUF");
    const ggufB = await b.training.models.checkpoints.download(model.id, 4, {
      format: "gguf",
    });
    expect((await bytesOf(ggufB.body)).equals(ggufBytes)).toBe(true);
    expect(ggufB.digest).toBe(ggufA.digest);

    // Nothing of it is in either data directory.
    for (const dir of dirs) expect(existsSync(join(dir, "blobs"))).toBe(false);
  });

  it("when a project's requests alternate between the replicas, then its requests per minute hold across both", async () => {
    const replicas = (project: string) =>
      urls.map((baseUrl) =>
        createArborClient({
          baseUrl,
          apiKey,
          maxRetries: 0,
          headers: { "Compat-Project": project },
        }),
      );
    const chat = (client: ArborClient) =>
      client.POST("/v1/chat/completions", {
        body: {
          model: "arbor/tiny-chat",
          messages: [{ role: "user", content: "Hi" }],
          max_tokens: 1,
        },
      });
    const limited = replicas("default/limited");
    const statuses: number[] = [];
    for (let i = 0; i < RPM + 3; i++) statuses.push((await chat(limited[i % 2]!)).response.status);
    expect(statuses).toEqual([200, 200, 200, 200, 429, 429, 429]);
    const refused = await chat(limited[1]!);
    expect(refused.error).toMatchObject({ error: { code: "rate_limit_exceeded" } });
    expect(refused.response.headers.get("x-ratelimit-limit-requests")).toBe(String(RPM));
    // Another project has a bucket of its own, on either replica.
    const other = replicas("default/other");
    expect((await chat(other[1]!)).response.status).toBe(200);
    expect((await chat(other[0]!)).response.status).toBe(200);
  });
});
