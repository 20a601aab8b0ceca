import { type ArborClient, unwrap } from "@arbor/client";
import { adapterToFiles, catalogModelDir, createLoraAdapter, loadModel } from "@arbor/engine/model";
import type { Store } from "@arbor/store";
import { writeCheckpointFiles } from "@arbor/training";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/** Defects an audit of malformed and oversized requests found (ADR 26–29), each pinned where the
 * HTTP layer owns it. */
let server: RunningServer;
let client: ArborClient;
beforeAll(async () => {
  server = await startServer();
  client = server.authorizedClient();
});
afterAll(() => server.close());

const chat = (model: string, content = "Hi", extra: Record<string, unknown> = {}) =>
  client.POST("/v1/chat/completions", {
    body: {
      model,
      messages: [{ role: "user", content }],
      max_tokens: 4,
      temperature: 0,
      ...extra,
    },
  });

async function newModel(name: string) {
  return await client.training.models.create({
    project: "hard",
    name,
    base_model: "arbor/tiny-chat",
  });
}

describe("createChatCompletion: accounting cannot be skipped", () => {
  it("when the store cannot record the call, then 503 before anything is generated", async () => {
    const failing = await startServer(
      {},
      {
        storeSeenByApp: (store) =>
          ({
            ...store,
            calls: Object.assign(Object.create(Object.getPrototypeOf(store.calls)), store.calls, {
              startCall: async () => {
                throw new Error("disk full");
              },
            }),
          }) as Store,
      },
    );
    try {
      const engine = await failing.engines.engine("arbor/tiny-chat");
      const before = (await engine.stats()).steps;
      const { response, error } = await failing.authorizedClient().POST("/v1/chat/completions", {
        body: {
          model: "arbor/tiny-chat",
          messages: [{ role: "user", content: "Hi" }],
          max_tokens: 4,
        },
      });
      expect(response.status).toBe(503);
      expect(response.headers.get("x-should-retry")).toBe("true");
      expect(error).toEqual({
        error: {
          message: expect.stringContaining("usage"),
          type: "server_error",
          param: null,
          code: null,
        },
      });
      expect((await engine.stats()).steps).toBe(before);
    } finally {
      await failing.close();
    }
  });

  it("when a chat's inputs are too large to keep, then it is served and recorded with its usage and a note instead of the inputs", async () => {
    const project = "default/accounting";
    // A schema can carry a long description: 1.5 MB of inputs for a prompt of a few tokens.
    const schema = { type: "object", description: "d".repeat(1_500_000) };
    const served = unwrap(
      await client.POST("/v1/chat/completions", {
        body: {
          model: "arbor/tiny-chat",
          messages: [{ role: "user", content: "Hi" }],
          max_tokens: 3,
          response_format: { type: "json_schema", json_schema: { name: "big", schema } },
        },
        headers: { "compat-project": project },
      }),
    );
    const { calls } = await client.calls.query({ project_id: project, limit: 10 });
    expect(calls).toHaveLength(1);
    expect(calls[0]!.inputs).toEqual({
      _arbor_omitted: { reason: "larger than the recording limit", bytes: expect.any(Number) },
    });
    const usage = await client.calls.usage({ project_id: project, call_ids: [calls[0]!.id] });
    expect(usage.call_usage[calls[0]!.id]?.[served.model]).toMatchObject({
      requests: 1,
      prompt_tokens: served.usage!.prompt_tokens,
      completion_tokens: served.usage!.completion_tokens,
    });
  });
});

describe("logModelMetrics: only finite numbers are stored", () => {
  it("when a reward is 1e308, then 400 and the model's checkpoints stay readable", async () => {
    const model = await newModel("overflow");
    const group = {
      trajectories: [
        { messages_and_choices: [{ role: "user" as const, content: "x" }], reward: 1e308 },
        { messages_and_choices: [{ role: "user" as const, content: "y" }], reward: 1e308 },
      ],
    };
    const logged = await client.POST("/v1/preview/models/{model_id}/log", {
      params: { path: { model_id: model.id } },
      body: { split: "train", trajectory_groups: [group] },
    });
    expect(logged.response.status).toBe(400);
    const listed = await client.GET("/v1/preview/models/{model_id}/checkpoints", {
      params: { path: { model_id: model.id } },
    });
    expect(listed.response.status).toBe(200);
  });

  it("when a stored metric is not a number (written before the check), then reads leave it out", async () => {
    const model = await newModel("legacy-metric");
    await server.store.sql.exec("UPDATE checkpoints SET metrics = $1 WHERE model_id = $2", [
      '{"ovf/reward": null, "train/loss": 0.5}',
      model.id,
    ]);
    const listed = await client.training.models.checkpoints.list(model.id);
    expect(listed.data[0]?.metrics).toEqual({ "train/loss": 0.5 });
  });
});

describe("a checkpoint deleted while it is being served", () => {
  it("when its files are gone by the time the request reads them, then 404, not 500", async () => {
    const model = await newModel("vanishing");
    const base = await loadModel(catalogModelDir("arbor/tiny-chat"));
    const files = adapterToFiles(createLoraAdapter(base, { baseModel: "arbor/tiny-chat" }));
    const prefix = await writeCheckpointFiles(server.store.blobs, model.id, 1, files);
    await server.store.models.addCheckpoint("default", model.id, { step: 1, blob_key: prefix });
    // The concurrent delete's second half: its row still read, its files already removed.
    await server.store.blobs.deletePrefix(prefix);
    const { response, error } = await chat("default/hard/vanishing:step1");
    expect(response.status).toBe(404);
    expect((error as { error: { code: string } }).error.code).toBe("model_not_found");
  });
});

describe("bounds in the spec", () => {
  it.each([
    ["..", "the name .."],
    ["a\u0000b", "a NUL"],
    ["x".repeat(1_000_000), "a 1 MB name"],
  ])("when a model is named %#, then 400 with a short message", async (name) => {
    const { response, error } = await client.POST("/v1/preview/models", {
      body: { project: "hard", name, base_model: "arbor/tiny-chat" },
    });
    expect(response.status).toBe(400);
    expect(JSON.stringify(error).length).toBeLessThan(1000);
  });

  it("when the project header names a ../ project, then 400", async () => {
    const { response } = await client.GET("/v1/models", {
      headers: { "compat-project": "default/.." },
    });
    expect(response.status).toBe(400);
  });

  it("when n is 9, then 400 naming n (the spec and the server agree on 8)", async () => {
    const { response, error } = await chat("arbor/tiny-chat", "Hi", { n: 9 });
    expect(response.status).toBe(400);
    expect((error as { error: { param: string } }).error.param).toBe("n");
    expect((await chat("arbor/tiny-chat", "Hi", { n: 8 })).response.status).toBe(200);
  });

  it("when a 200 KB model id is asked for, then the error quotes a short prefix", async () => {
    const { response, error } = await chat(`a/${"b".repeat(200_000)}`);
    expect(response.status).toBe(400);
    expect(JSON.stringify(error).length).toBeLessThan(1000);
  });

  it.each([
    [
      "10,001 call ids",
      "/calls/usage",
      { project_id: "default/p", call_ids: Array.from({ length: 10_001 }, (_, i) => `c${i}`) },
    ],
    ["offset 1e308", "/calls/query", { project_id: "default/p", offset: 1e308 }],
    ["a NUL in a call id", "/calls/usage", { project_id: "default/p", call_ids: ["a\u0000b"] }],
  ])("when /calls gets %s, then 422 in the detail shape", async (_, path, body) => {
    const { response, error } = await client.POST(path as "/calls/usage", { body: body as never });
    expect(response.status).toBe(422);
    expect(Array.isArray((error as { detail: unknown }).detail)).toBe(true);
  });

  it.each([
    ["steps [1e308]", [1e308]],
    ["1,001 steps", Array.from({ length: 1001 }, (_, i) => i + 1)],
  ])("when a checkpoint delete names %s, then 400", async (_, steps) => {
    const model = await newModel(`steps-${steps.length}`);
    const { response } = await client.DELETE("/v1/preview/models/{model_id}/checkpoints", {
      params: { path: { model_id: model.id } },
      body: { steps },
    });
    expect(response.status).toBe(400);
  });
});

describe("createSftTrainingJob: a job's size is bounded", () => {
  it("when a dataset's lines times the epochs pass the limit, then 400 before anything is queued", async () => {
    const model = await newModel("huge-job");
    const line = JSON.stringify({
      messages: [
        { role: "user", content: "a" },
        { role: "assistant", content: "b" },
      ],
    });
    const dataset = await client.training.datasets.create(
      Array.from({ length: 10_001 }, () => line).join("\n"),
    );
    const { response, error } = await client.POST("/v1/preview/sft-training-jobs", {
      body: { model_id: model.id, training_data_url: dataset.url, config: { epochs: 1000 } },
    });
    expect(response.status).toBe(400);
    expect(error).toEqual({
      error: {
        message: expect.stringContaining("limit of 10000000"),
        type: "invalid_request_error",
        param: "config.epochs",
        code: "job_too_large",
      },
    });
    const queued = await server.store.jobs.list("default", { model_id: model.id });
    expect(queued.data).toEqual([]);
  });
});
