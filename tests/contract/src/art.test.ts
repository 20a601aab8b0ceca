import { readFileSync } from "node:fs";
import { join } from "node:path";
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
const FIXTURES = join(import.meta.dirname, "..", "fixtures", "art");

/** ART's RL request body as sent: trajectory items as JSON objects, its experimental_config. */
interface ArtRlBody {
  model_id: string;
  trajectory_groups: { trajectories: { messages_and_choices: Record<string, unknown>[] }[] }[];
  experimental_config: Record<string, unknown>;
}

/** fixtures/art/rl-job.json for `modelId`, parsed (its choices' placeholders left as they are). */
function artRlFixture(modelId: string): ArtRlBody {
  return JSON.parse(
    readFileSync(join(FIXTURES, "rl-job.json"), "utf8").replace("MODEL_ID", modelId),
  ) as ArtRlBody;
}

/** ART's RL request body (fixtures/art/rl-job.json) for `modelId`, each choice filled in from a
 * real completion sampled with logprobs, dumped as openai-python dumps it. */
function artRlBody(modelId: string, sampled: OpenAI.ChatCompletion[]): string {
  let body = readFileSync(join(FIXTURES, "rl-job.json"), "utf8").replace("MODEL_ID", modelId);
  sampled.forEach((completion, i) => {
    const letter = "AB"[i]!;
    const choice = completion.choices[0]!;
    const tokens = choice.logprobs!.content!.map((t) => ({
      token: t.token,
      bytes: t.bytes,
      logprob: t.logprob,
      top_logprobs: t.top_logprobs,
    }));
    body = body
      .replace(`"LOGPROBS_${letter}"`, JSON.stringify(tokens))
      .replace(`"CONTENT_${letter}"`, JSON.stringify(choice.message.content));
  });
  return body;
}
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
  const newModel = (name: string) =>
    client.training.models.create({ project: "art", name, base_model: BASE });
  /** POSTs a body as the client's bytes (a string) or as JSON, with the admin's key. */
  const postJson = (path: string, body: unknown) =>
    fetch(`${server.baseUrl}${path}`, {
      method: "POST",
      headers: { authorization: `Bearer ${server.adminKey}`, "content-type": "application/json" },
      body: typeof body === "string" ? body : JSON.stringify(body),
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
      // With a fixed seed all four were the same; random ones may still coincide now and then.
      expect(new Set(texts).size).toBeGreaterThan(1);
      const n = await openai.chat.completions.create({
        model: BASE,
        messages: [{ role: "user", content: "Name an animal." }],
        temperature: 1.2,
        max_tokens: 12,
        n: 3,
      });
      expect(new Set(n.choices.map((c) => c.message.content)).size).toBeGreaterThan(1);
      const [a, b] = await Promise.all([rollout(42), rollout(42)]);
      expect(b.choices[0]!.message.content).toBe(a.choices[0]!.message.content);
    },
  );

  it.skipIf(skip !== null)(
    "when a trained model is named as ART names it (wandb-artifact:///…), then it chats and is retrieved as its plain id, and another tenant's stays unknown",
    async () => {
      const model = await newModel("names");
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

  it.skipIf(skip !== null)(
    "when ART sends an RL job of choices dumped by openai-python (nulls, extras) with its 25-key experimental_config, then it trains with a non-zero gradient, and /log takes the same groups",
    async () => {
      const model = await newModel("rl");
      const sample = () =>
        openai.chat.completions.create({
          model: `wandb-artifact:///default/art/rl`,
          messages: [
            { role: "system", content: "Answer with one word." },
            { role: "user", content: "Name an animal." },
          ],
          temperature: 1,
          max_tokens: 6,
          logprobs: true,
        });
      // Two different answers (sampling is random; identical ones would cancel each other).
      let pair = await Promise.all([sample(), sample()]);
      for (
        let i = 0;
        i < 20 && pair[0].choices[0]!.message.content === pair[1].choices[0]!.message.content;
        i++
      )
        pair = await Promise.all([sample(), sample()]);
      const body = artRlBody(model.id, pair);
      const response = await postJson("/v1/preview/training-jobs", body);
      expect(response.status, await response.clone().text()).toBe(200);
      const job = (await response.json()) as { id: string };
      const events = await followAll(client, job.id);
      const step = events.find((e) => e.type === "gradient_step")!.data as Record<string, number>;
      expect(events.at(-1)!.type).toBe("training_ended");
      expect(step.grad_norm).toBeGreaterThan(1e-4);
      expect(Math.abs(step.loss!)).toBeGreaterThan(1e-6);
      const groups = (JSON.parse(body) as { trajectory_groups: unknown[] }).trajectory_groups;
      const log = await postJson(`/v1/preview/models/${model.id}/log`, {
        split: "val",
        trajectory_groups: groups,
      });
      expect(log.status, await log.clone().text()).toBe(200);
    },
  );

  it.skipIf(skip !== null)(
    "when a trajectory item is malformed, then the 400 names what the item was meant to be: a choice by its fields, a message by its role",
    async () => {
      const model = await newModel("bad");
      const refused = async (item: unknown) => {
        const response = await postJson("/v1/preview/training-jobs", {
          model_id: model.id,
          trajectory_groups: [
            {
              trajectories: [
                { messages_and_choices: [{ role: "user", content: "hi" }, item], reward: 1 },
              ],
            },
          ],
        });
        expect(response.status).toBe(400);
        return ((await response.json()) as { error: { message: string; param: string } }).error;
      };
      const at = "trajectory_groups[0].trajectories[0].messages_and_choices[1]";
      const choice = {
        finish_reason: "stop",
        index: 0,
        logprobs: {
          content: [{ token: "a", bytes: null, logprob: "low", top_logprobs: [] }],
          refusal: null,
        },
        message: { content: "a", refusal: null, role: "assistant" },
      };
      expect(await refused(choice)).toMatchObject({
        param: `${at}.logprobs.content[0].logprob`,
        message: expect.stringMatching(/logprob: must be number/),
      });
      expect(await refused({ index: 0, finish_reason: "stop" })).toMatchObject({
        param: `${at}.message`,
        message: expect.stringMatching(/must have required property 'message'/),
      });
      expect(await refused({ role: "user", content: 5 })).toMatchObject({
        param: expect.stringMatching(
          /^trajectory_groups\[0\]\.trajectories\[0\]\.messages_and_choices\[1\]\.content/,
        ),
      });
    },
  );

  it.skipIf(skip !== null)(
    "when ART sends an SFT job (no epochs, a learning rate per batch), then it makes one pass in file order, each batch at its rate; a list of another length is refused",
    async () => {
      const model = await newModel("sft");
      const data = await client.training.datasets.create(
        ["cat", "dog", "sun", "map"].map((w) => JSON.stringify(reversal(w))).join("\n"),
      );
      const post = (body: string) => postJson("/v1/preview/sft-training-jobs", body);
      const body = readFileSync(join(FIXTURES, "sft-job.json"), "utf8")
        .replace("MODEL_ID", model.id)
        .replace("DATA_URL", data.url);
      const response = await post(body);
      expect(response.status, await response.clone().text()).toBe(200);
      const events = await followAll(client, ((await response.json()) as { id: string }).id);
      const steps = events
        .filter((e) => e.type === "gradient_step")
        .map((e) => e.data.learning_rate);
      expect(steps).toEqual([0.003, 0.0015]);
      expect(events.at(-1)!.type).toBe("training_ended");

      const sent = JSON.parse(body) as { config: { learning_rate: number[] } };
      sent.config.learning_rate = [0.003, 0.002, 0.001];
      const three = await post(JSON.stringify(sent));
      const artifact = await post(
        body.replace(data.url, "wandb-artifact:///default/art/sft-sft-data-0a1b2c3d4e5f:v0"),
      );
      expect(artifact.status).toBe(400);
      expect(((await artifact.json()) as { error: unknown }).error).toMatchObject({
        code: "unsupported_training_data_url",
        message: expect.stringMatching(/dataset:\/\//),
      });
      expect(three.status).toBe(400);
      expect(((await three.json()) as { error: unknown }).error).toMatchObject({
        code: "invalid_learning_rate",
        param: "config.learning_rate",
        message: expect.stringMatching(/3 values for the job's 2 batches/),
      });
    },
  );

  it.skipIf(skip !== null)(
    "when ART's settings say what not to train (no logprobs while allow_training_without_logprobs is false), then the step advances without learning and says why; settings that cannot hold are 400",
    async () => {
      const model = await newModel("nolp");
      const body = artRlFixture(model.id);
      for (const t of body.trajectory_groups[0]!.trajectories) {
        const choice = t.messages_and_choices[2]!;
        choice.logprobs = null;
        (choice.message as Record<string, unknown>).content = "cat";
      }
      const post = (sent: unknown) => postJson("/v1/preview/training-jobs", sent);
      const response = await post(body);
      expect(response.status, await response.clone().text()).toBe(200);
      const events = await followAll(client, ((await response.json()) as { id: string }).id);
      expect(events.find((e) => e.type === "gradient_step")!.data).toMatchObject({
        num_trajectories_dropped: 2,
        num_trajectories_trained: 0,
        grad_norm: 0,
      });
      expect(events.at(-1)!.type).toBe("training_ended");
      expect(
        (await client.training.models.checkpoints.list(model.id)).data.map((c) => c.step),
      ).toContain(1);

      for (const [key, value] of [
        ["ppo", true],
        ["kl_ref_adapter_path", "/home/me/ref"],
      ] as const) {
        const refused = await post({
          ...body,
          experimental_config: { ...body.experimental_config, [key]: value },
        });
        expect(refused.status).toBe(400);
        expect(((await refused.json()) as { error: { param: string } }).error.param).toBe(
          `experimental_config.${key}`,
        );
      }
    },
  );

  it.skipIf(skip !== null)(
    "when the KL penalty names a checkpoint as its reference, then the step measures against it; a reference that does not exist fails the job naming it",
    async () => {
      const model = await newModel("kl");
      const body = artRlFixture(model.id);
      for (const [i, t] of body.trajectory_groups[0]!.trajectories.entries()) {
        t.messages_and_choices[2] = {
          index: 0,
          finish_reason: "stop",
          logprobs: null,
          message: { role: "assistant", content: ["cat", "owl"][i] },
        };
      }
      const run = async (config: Record<string, unknown>) => {
        const response = await postJson("/v1/preview/training-jobs", {
          ...body,
          experimental_config: {
            ...body.experimental_config,
            allow_training_without_logprobs: null,
            learning_rate: 0.01,
            ...config,
          },
        });
        expect(response.status, await response.clone().text()).toBe(200);
        return followAll(client, ((await response.json()) as { id: string }).id);
      };
      await run({});
      await run({});
      const measured = await run({ kl_penalty_coef: 1, kl_penalty_reference_step: 1 });
      const step = measured.find((e) => e.type === "gradient_step")!.data as Record<string, number>;
      expect(Math.abs(step.kl_policy_ref!)).toBeGreaterThan(0);
      const lagged = await run({ kl_penalty_coef: 1, kl_penalty_step_lag: 1 });
      expect(lagged.at(-1)!.type).toBe("training_ended");
      const missing = await run({ kl_penalty_coef: 1, kl_penalty_reference_step: 99 });
      expect(missing.at(-1)).toMatchObject({
        type: "training_failed",
        data: { error_message: expect.stringMatching(/checkpoint step 99/) },
      });
    },
  );
});
