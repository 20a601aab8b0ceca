import type { ArborClient } from "@arbor/client";
import OpenAI from "openai";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { followAll, reversal } from "./jobs.ts";
import { PG_URL, pgSkipReason } from "./pg.ts";

/**
 * The hosted API's own client, OpenPipe ART (`art.ServerlessBackend`), drives these routes
 * unchanged: its rollouts are sampled without a seed, it chats with artifact names, its
 * trajectories carry choices as openai-python dumps them, and its SFT sends one pass. Each case
 * runs on SQLite and on PostgreSQL.
 */
const BASE = "arbor/tiny-chat";
const stores = [
  { name: "SQLite", postgres: undefined, skip: null },
  { name: "PostgreSQL", postgres: { url: PG_URL }, skip: pgSkipReason },
] as const;

describe.each(stores)("ART's flow on $name", ({ postgres, skip }) => {
  let server: RunningServer;
  let client: ArborClient;
  let openai: OpenAI;
  beforeAll(async () => {
    if (skip !== null) return;
    server = await startServer({}, { worker: true, ...(postgres ? { postgres } : {}) });
    client = server.authorizedClient();
    openai = new OpenAI({
      baseURL: `${server.baseUrl}/v1`,
      apiKey: server.adminKey,
      maxRetries: 0,
    });
  });
  afterAll(async () => {
    await server?.close();
  });

  it.skipIf(skip !== null)(
    "when a group of rollouts of one prompt is sampled without a seed, then they differ; with one seed they repeat",
    async () => {
      const rollout = (seed?: number) =>
        openai.chat.completions.create({
          model: BASE,
          messages: [{ role: "user", content: "Name an animal." }],
          temperature: 1.2,
          max_tokens: 12,
          ...(seed === undefined ? {} : { seed }),
        });
      const group = await Promise.all([rollout(), rollout(), rollout(), rollout()]);
      const texts = group.map((c) => c.choices[0]!.message.content);
      expect(new Set(texts).size).toBe(4);
      const n = await openai.chat.completions.create({
        model: BASE,
        messages: [{ role: "user", content: "Name an animal." }],
        temperature: 1.2,
        max_tokens: 12,
        n: 3,
      });
      expect(new Set(n.choices.map((c) => c.message.content)).size).toBe(3);
      const [a, b] = await Promise.all([rollout(42), rollout(42)]);
      expect(b.choices[0]!.message.content).toBe(a.choices[0]!.message.content);
    },
  );

  it.skipIf(skip !== null)(
    "when a trained model is named as ART names it (wandb-artifact:///…), then it chats and is retrieved as its plain id, and another tenant's stays unknown",
    async () => {
      const model = await client.training.models.create({
        project: "art",
        name: "names",
        base_model: BASE,
      });
      const data = await client.training.datasets.create(
        ["cat", "dog"].map((w) => JSON.stringify(reversal(w))).join("\n"),
      );
      const job = await client.training.jobs.createSft({
        model_id: model.id,
        training_data_url: data.url,
        config: { batch_size: 2 },
      });
      await followAll(client, job.id);
      for (const name of [
        "wandb-artifact:///default/art/names",
        "wandb-artifact:///default/art/names:step1",
      ]) {
        const answer = await openai.chat.completions.create({
          model: name,
          messages: [{ role: "user", content: "Reverse the word cat." }],
          max_tokens: 4,
          temperature: 0,
        });
        expect(answer.model).toBe("default/art/names:step1");
        expect((await openai.models.retrieve(name)).id).toBe(
          name.slice("wandb-artifact:///".length),
        );
        const raw = await fetch(`${server.baseUrl}/v1/models/${name}`, {
          headers: { authorization: `Bearer ${server.adminKey}` },
        });
        expect(raw.status).toBe(200);
      }
      const other = await server.newTenant("art-other");
      const theirs = new OpenAI({
        baseURL: `${server.baseUrl}/v1`,
        apiKey: other.apiKey,
        maxRetries: 0,
      });
      await expect(
        theirs.chat.completions.create({
          model: "wandb-artifact:///default/art/names",
          messages: [{ role: "user", content: "hi" }],
          max_tokens: 2,
        }),
      ).rejects.toMatchObject({ status: 404, code: "model_not_found" });
      await expect(
        openai.models.retrieve("wandb-artifact:///default/art/nobody"),
      ).rejects.toMatchObject({
        status: 404,
      });
    },
  );
});
