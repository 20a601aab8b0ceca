import { existsSync } from "node:fs";
import { join } from "node:path";
import { adapterToFiles, catalogModelDir, createLoraAdapter, loadModel } from "@arbor/engine/model";
import tar from "tar-stream";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { PG_URL, pgSkipReason } from "./pg.ts";

/**
 * Deleting a model, or some of its checkpoints, while adapter uploads to it run: every answer is
 * a 2xx, a 404 or a 409, never a 5xx, and no file is left that no row names. On SQLite with
 * files, on PostgreSQL with its blob tables, and on PostgreSQL with files (replicas sharing a
 * directory).
 */
const BASE = "arbor/tiny-chat";
const stores = [
  { name: "SQLite, files", postgres: undefined, env: {}, skip: null },
  { name: "PostgreSQL", postgres: { url: PG_URL }, env: {}, skip: pgSkipReason },
  {
    name: "PostgreSQL, files",
    postgres: { url: PG_URL },
    env: { ARBOR_BLOBS: "fs" },
    skip: pgSkipReason,
  },
] as const;

let adapter: Buffer;
beforeAll(async () => {
  const base = await loadModel(catalogModelDir(BASE));
  const files = adapterToFiles(createLoraAdapter(base, { baseModel: BASE, rank: 128 }));
  const pack = tar.pack();
  for (const [name, body] of Object.entries(files)) pack.entry({ name }, Buffer.from(body));
  pack.finalize();
  const chunks: Buffer[] = [];
  for await (const chunk of pack) chunks.push(chunk as Buffer);
  adapter = Buffer.concat(chunks);
});

describe.each(stores)("deletes racing adapter uploads on $name", ({ postgres, env, skip }) => {
  let server: RunningServer;
  beforeAll(async () => {
    if (skip !== null) return;
    server = await startServer({}, { ...(postgres ? { postgres } : {}), env });
  });
  afterAll(async () => {
    await server?.close();
  });

  const auth = () => ({ authorization: `Bearer ${server.adminKey}` });
  const upload = (modelId: string) =>
    fetch(`${server.baseUrl}/v1/preview/models/${modelId}/checkpoints`, {
      method: "POST",
      headers: { ...auth(), "content-type": "application/x-tar" },
      body: adapter,
    });
  const send = (method: string, path: string, body?: unknown) =>
    fetch(`${server.baseUrl}${path}`, {
      method,
      headers: { ...auth(), "content-type": "application/json" },
      ...(body === undefined ? {} : { body: JSON.stringify(body) }),
    });
  /** Answers' statuses, each read whole (a 5xx's body says why). */
  const statuses = async (answers: Promise<Response>[]) =>
    Promise.all(
      answers.map(async (answer) => {
        const response = await answer;
        const text = await response.text();
        return { status: response.status, text };
      }),
    );
  const files = (modelId: string) => server.store.blobs.list(`checkpoints/${modelId}/`);

  it.skipIf(skip !== null)(
    "when a model is deleted while uploads to it run, then each answers 2xx, 404 or 409, and none of its files or folders stay",
    async () => {
      for (let round = 0; round < 6; round++) {
        const model = await server.authorizedClient().training.models.create({
          project: "races",
          name: `deleted-${round}`,
          base_model: BASE,
        });
        const uploads = Array.from({ length: 10 }, () => upload(model.id));
        // The delete goes once the first upload has answered, while the others are in flight
        // (some writing their files, some before their row), or at once in the first round.
        const deleted = (round === 0 ? Promise.resolve() : Promise.race(uploads)).then(() =>
          send("DELETE", `/v1/preview/models/${model.id}`),
        );
        const answers = await statuses([...uploads, deleted]);
        for (const { status, text } of answers)
          expect([200, 404, 409], `${status} ${text}`).toContain(status);
        expect(answers.at(-1)!.status).toBe(200);
        expect(await files(model.id)).toEqual([]);
        if (!postgres || "ARBOR_BLOBS" in env)
          expect(existsSync(join(server.dataDir, "blobs", "checkpoints", model.id))).toBe(false);
        expect(await server.store.models.get("default", model.id)).toBeUndefined();
      }
    },
  );

  it.skipIf(skip !== null)(
    "when checkpoints are deleted while uploads run, then each answers 2xx, 404 or 409, and every file left is a listed checkpoint's",
    async () => {
      const client = server.authorizedClient();
      const model = await client.training.models.create({
        project: "races",
        name: "pruned",
        base_model: BASE,
      });
      for (let round = 0; round < 4; round++) {
        const { data } = await client.training.models.checkpoints.list(model.id, { limit: 100 });
        const steps = data.map((c) => c.step);
        const uploads = Array.from({ length: 6 }, () => upload(model.id));
        const pruned = Promise.race(uploads).then(() =>
          send("DELETE", `/v1/preview/models/${model.id}/checkpoints`, { steps }),
        );
        for (const { status, text } of await statuses([...uploads, pruned]))
          expect([200, 404, 409], `${status} ${text}`).toContain(status);
      }
      const listed = await server.store.models.listCheckpoints("default", model.id, {
        limit: 100,
      });
      const named = new Set(listed.data.flatMap((c) => (c.blob_key ? [c.blob_key] : [])));
      const folders = new Set(
        (await files(model.id)).map((key) => `${key.split("/").slice(0, 3).join("/")}/`),
      );
      expect([...folders].sort()).toEqual([...named].sort());
    },
  );
});
