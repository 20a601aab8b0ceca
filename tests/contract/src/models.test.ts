import { type ArborClient, unwrap } from "@arbor/client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

const BASE = "arbor/tiny-chat";
let server: RunningServer;
let client: ArborClient;
beforeAll(async () => {
  server = await startServer();
  client = server.authorizedClient();
});
afterAll(() => server.close());

async function create(name: string, extra: Record<string, unknown> = {}) {
  return await client.training.models.create({
    entity: null,
    project: "proj",
    name,
    base_model: BASE,
    ...extra,
  });
}

/** Adds checkpoints as a finished job would, to exercise paging and deletion. */
async function addSteps(modelId: string, steps: number[]) {
  for (const step of steps)
    await server.store.models.addCheckpoint("default", modelId, {
      step,
      metrics: { loss: 1 / step },
    });
}

describe("createModel", () => {
  it("when created, then it answers the model at step 0, chattable at once", async () => {
    const model = await create("first");
    expect(model).toEqual({
      id: expect.stringMatching(/^[0-9a-f-]{36}$/),
      object: "model",
      entity: "default",
      project: "proj",
      name: "first",
      base_model: BASE,
      run_id: null,
      created_at: expect.any(Number),
      latest_step: 0,
    });
    const chat = await client.chat.completions.create({
      model: "default/proj/first",
      messages: [{ role: "user", content: "Hi" }],
      max_tokens: 3,
      temperature: 0,
    });
    expect(chat.model).toBe("default/proj/first:step0");
    const base = await client.chat.completions.create({
      model: BASE,
      messages: [{ role: "user", content: "Hi" }],
      max_tokens: 3,
      temperature: 0,
    });
    expect(chat.choices[0]!.message.content).toBe(base.choices[0]!.message.content);
  });

  it("when the name is taken, then 409; with return_existing, the same model", async () => {
    const model = await create("dup");
    const { response, error } = await client.POST("/v1/preview/models", {
      body: { project: "proj", name: "dup", base_model: BASE },
    });
    expect(response.status).toBe(409);
    expect(error).toEqual({
      error: {
        message: "Model default/proj/dup already exists; send return_existing: true to get it.",
        type: "conflict_error",
        param: null,
        code: "model_exists",
      },
    });
    expect(await create("dup", { return_existing: true })).toEqual(model);
  });

  it("when two creates of one name race, then exactly one model and one 409", async () => {
    const results = await Promise.all(
      [1, 2].map(() =>
        client.POST("/v1/preview/models", {
          body: { project: "proj", name: "race", base_model: BASE },
        }),
      ),
    );
    expect(results.map((r) => r.response.status).sort()).toEqual([200, 409]);
    const { data } = await server.store.models.list(["default"], { project: "proj" });
    expect(data.filter((m) => m.name === "race")).toHaveLength(1);
  });

  it("when the base model is unknown, then 400 unsupported_base_model listing the supported ids", async () => {
    const { response, error } = await client.POST("/v1/preview/models", {
      body: { project: "proj", name: "x", base_model: "meta/llama-70b" },
    });
    expect(response.status).toBe(400);
    expect(error).toEqual({
      error: {
        message: `Unsupported base_model "meta/llama-70b". Supported: ${BASE}.`,
        type: "invalid_request_error",
        param: "base_model",
        code: "unsupported_base_model",
      },
    });
  });

  it("when the entity is not the key's, then 403", async () => {
    const { response } = await client.POST("/v1/preview/models", {
      body: { entity: "elsewhere", project: "proj", name: "x", base_model: BASE },
    });
    expect(response.status).toBe(403);
  });
});

describe("listTrainableModels", () => {
  it("when a project's models are listed, then they come newest first, paged, and only that project's", async () => {
    const made = [];
    for (const name of ["l1", "l2", "l3"]) {
      made.push(
        await client.training.models.create({ project: "listing", name, base_model: BASE }),
      );
    }
    await create("elsewhere");
    const first = unwrap(
      await client.GET("/v1/preview/models", {
        params: { query: { project: "listing", limit: 2 } },
      }),
    );
    expect(first).toEqual({
      object: "list",
      data: [made[2], made[1]],
      first_id: made[2]!.id,
      last_id: made[1]!.id,
      has_more: true,
    });
    const rest = unwrap(
      await client.GET("/v1/preview/models", {
        params: { query: { project: "listing", limit: 2, after: first.last_id! } },
      }),
    );
    expect(rest).toMatchObject({ data: [made[0]], has_more: false });
    const all = [];
    for await (const m of client.training.models.list({ project: "listing", limit: 1 }))
      all.push(m.name);
    expect(all).toEqual(["l3", "l2", "l1"]);
  });

  it("when another entity lists models, then it sees only its own; a bad limit is 400", async () => {
    await create("not-yours");
    const stranger = await server.newTenant("lister");
    await stranger.client.training.models.create({ project: "p", name: "mine", base_model: BASE });
    const names = [];
    for await (const m of stranger.client.training.models.list())
      names.push(`${m.entity}/${m.name}`);
    expect(names).toEqual(["lister/mine"]);
    const bad = await client.GET("/v1/preview/models", { params: { query: { limit: 0 } } });
    expect(bad.response.status).toBe(400);
    expect(bad.error).toMatchObject({ error: { param: "limit" } });
  });
});

describe("listCheckpoints", () => {
  it("when paged by after in either order, then steps come sorted, none skipped or repeated", async () => {
    const model = await create("paged");
    await addSteps(model.id, [1, 2, 3, 4]);
    const desc = [];
    for await (const c of client.training.models.checkpoints.list(model.id, {
      limit: 2,
      order: "desc",
    })) {
      desc.push(c);
    }
    expect(desc.map((c) => c.step)).toEqual([4, 3, 2, 1, 0]);
    expect(desc[0]).toEqual({
      id: expect.any(String),
      object: "checkpoint",
      step: 4,
      metrics: { loss: 0.25 },
      created_at: expect.any(Number),
      model: "default/proj/paged:step4",
    });
    // Oldest first by default, as the hosted API lists them.
    const asc = await client.training.models.checkpoints.list(model.id, { limit: 100 });
    expect(asc.data.map((c) => c.step)).toEqual([0, 1, 2, 3, 4]);
    expect(asc.has_more).toBe(false);
    const last = unwrap(
      await client.GET("/v1/preview/models/{model_id}/checkpoints", {
        params: { path: { model_id: model.id }, query: { order: "asc", after: asc.last_id! } },
      }),
    );
    expect(last).toEqual({
      object: "list",
      data: [],
      first_id: null,
      last_id: null,
      has_more: false,
    });
  });

  it("when the model does not exist, then 404", async () => {
    const { response, error } = await client.GET("/v1/preview/models/{model_id}/checkpoints", {
      params: { path: { model_id: "0193a0b6-0a1b-7c2d-8e3f-4a5b6c7d8e9f" } },
    });
    expect(response.status).toBe(404);
    expect((error as { error: { type: string } }).error.type).toBe("not_found_error");
  });
});

describe("deleteCheckpoints", () => {
  it("when steps are deleted, then they are gone, missing ones are reported, and the latest is refused", async () => {
    const model = await create("pruned");
    await addSteps(model.id, [1, 2]);
    const result = await client.training.models.checkpoints.delete(model.id, [0, 1, 7]);
    expect(result).toEqual({ deleted_count: 2, not_found_steps: [7] });
    const { response, error } = await client.DELETE("/v1/preview/models/{model_id}/checkpoints", {
      params: { path: { model_id: model.id } },
      body: { steps: [2] },
    });
    expect(response.status).toBe(409);
    expect((error as { error: { type: string; code: string } }).error).toMatchObject({
      type: "conflict_error",
      code: "latest_checkpoint",
    });
    const { data } = await client.models.list({ include: "checkpoints" });
    expect(data.map((m) => m.id).filter((id) => id.startsWith("default/proj/pruned"))).toEqual([
      "default/proj/pruned",
      "default/proj/pruned:step2",
    ]);
    // Without it, each trained model once.
    const plain = await client.models.list();
    expect(
      plain.data.map((m) => m.id).filter((id) => id.startsWith("default/proj/pruned")),
    ).toEqual(["default/proj/pruned"]);
    expect((await client.models.retrieve("default/proj/pruned:step2")).parent).toBe(
      "default/proj/pruned",
    );
  });
});

describe("logModelMetrics", () => {
  it("when a split is logged, then its reward metrics are stored on the latest checkpoint", async () => {
    const model = await create("logged");
    const choice = {
      index: 0,
      finish_reason: "stop",
      message: { role: "assistant", content: "4" },
    };
    const trajectory = (reward: number, correct: boolean) => ({
      messages_and_choices: [{ role: "user", content: "2+2?" }, choice],
      reward,
      metrics: { correct },
    });
    const result = unwrap(
      await client.POST("/v1/preview/models/{model_id}/log", {
        params: { path: { model_id: model.id } },
        body: {
          split: "val",
          trajectory_groups: [
            { trajectories: [trajectory(1, true), trajectory(0, false)] },
            {
              trajectories: [trajectory(1, true), trajectory(1, true)],
              exceptions: [{ message: "timeout" }],
            },
          ],
        } as never,
      }),
    );
    expect(result).toEqual({
      step: 0,
      metrics: {
        "val/reward": 0.75,
        "val/reward_std_dev": 0.25,
        "val/exception_rate": 0.2,
        "val/correct": 0.75,
      },
    });
    const { data } = await client.training.models.checkpoints.list(model.id);
    expect(data[0]!.metrics).toEqual(result.metrics);
  });

  it("when a metric's name is over 256 characters, then 400 naming its map, and nothing is stored", async () => {
    const model = await create("long-names");
    const log = (name: string) =>
      client.POST("/v1/preview/models/{model_id}/log", {
        params: { path: { model_id: model.id } },
        body: {
          split: "val",
          trajectory_groups: [
            {
              trajectories: [
                {
                  messages_and_choices: [{ role: "user", content: "2+2?" }],
                  reward: 1,
                  metrics: { [name]: 1 },
                },
              ],
            },
          ],
        } as never,
      });
    for (const name of ["m".repeat(257), "m".repeat(100_000)]) {
      const { response, error } = await log(name);
      expect(response.status).toBe(400);
      expect(error).toMatchObject({
        error: {
          type: "invalid_request_error",
          param: "trajectory_groups[0].trajectories[0].metrics",
          message: expect.stringContaining("256 characters"),
        },
      });
      expect(JSON.stringify(error).length).toBeLessThan(2000);
    }
    const before = await client.training.models.checkpoints.list(model.id);
    expect(before.data[0]!.metrics).toEqual({});
    expect((await log("m".repeat(256))).response.status).toBe(200);
    const { data } = await client.training.models.checkpoints.list(model.id);
    expect(Object.keys(data[0]!.metrics)).toContain(`val/${"m".repeat(256)}`);
  });
});

describe("deleteModel", () => {
  it("when deleted, then its checkpoints go, and it no longer lists or chats", async () => {
    const model = await create("doomed");
    await addSteps(model.id, [1]);
    expect(await client.training.models.delete(model.id)).toEqual({
      model_id: model.id,
      deleted_checkpoints: 2,
      deleted_run: false,
    });
    const { data } = await client.models.list();
    expect(data.some((m) => m.id.startsWith("default/proj/doomed"))).toBe(false);
    const chat = await client.POST("/v1/chat/completions", {
      body: {
        model: "default/proj/doomed",
        messages: [{ role: "user", content: "Hi" }],
      },
    });
    expect(chat.response.status).toBe(404);
    const again = await client.DELETE("/v1/preview/models/{model_id}", {
      params: { path: { model_id: model.id } },
    });
    expect(again.response.status).toBe(404);
  });
});

describe("tenant isolation", () => {
  it("when another entity's key reaches for a model, then every answer is not found, never the data", async () => {
    const model = await create("private");
    const stranger = (await server.newTenant("outsider")).client;
    const path = { params: { path: { model_id: model.id } } };
    const answers = await Promise.all([
      stranger.GET("/v1/preview/models/{model_id}/checkpoints", path),
      stranger.DELETE("/v1/preview/models/{model_id}/checkpoints", {
        ...path,
        body: { steps: [0] },
      }),
      stranger.POST("/v1/preview/models/{model_id}/log", {
        ...path,
        body: {
          split: "x",
          trajectory_groups: [
            {
              trajectories: [
                {
                  messages_and_choices: [
                    { role: "user", content: "hi" },
                    {
                      index: 0,
                      finish_reason: "stop",
                      message: { role: "assistant", content: "yo" },
                    },
                  ],
                  reward: 1,
                },
              ],
            },
          ],
        } as never,
      }),
      stranger.DELETE("/v1/preview/models/{model_id}", path),
      stranger.POST("/v1/chat/completions", {
        body: {
          model: "default/proj/private",
          messages: [{ role: "user", content: "Hi" }],
        },
      }),
      stranger.GET("/v1/models/{model}", { params: { path: { model: "default/proj/private" } } }),
    ]);
    for (const { response } of answers) expect(response.status).toBe(404);
    const { data } = await stranger.models.list();
    expect(data.some((m) => m.id.startsWith("default/"))).toBe(false);
    expect(await server.store.models.get("default", model.id)).toBeDefined();
  });
});
