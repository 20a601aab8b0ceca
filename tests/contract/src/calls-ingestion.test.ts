import { type ArborClient, unwrap } from "@arbor/client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { PG_URL, pgSkipReason } from "./pg.ts";

let server: RunningServer;
let client: ArborClient;
beforeAll(async () => {
  server = await startServer();
  client = server.authorizedClient();
});
afterAll(() => server.close());

const start = (project_id: string, id: string, extra: Record<string, unknown> = {}) => ({
  project_id,
  id,
  op_name: "agent.step",
  started_at: "2026-11-01T10:00:00Z",
  ...extra,
});
const end = (project_id: string, id: string, extra: Record<string, unknown> = {}) => ({
  project_id,
  id,
  ended_at: "2026-11-01T10:00:05Z",
  ...extra,
});

async function query(
  project_id: string,
  filter: Record<string, unknown> = {},
  page: { limit?: number; offset?: number } = {},
) {
  return await client.calls.query({ project_id, filter, ...page });
}

describe("startCall", () => {
  it("when a start has no id or trace id, then both are generated", async () => {
    const result = await client.calls.start({
      start: { project_id: "default/s1", op_name: "op", started_at: "2026-11-01T10:00:00Z" },
    });
    expect(result.id).toMatch(/^[0-9a-f-]{36}$/);
    expect(result.trace_id).toMatch(/^[0-9a-f-]{36}$/);
    const [call] = (await query("default/s1")).calls;
    expect(call).toMatchObject({
      id: result.id,
      trace_id: result.trace_id,
      parent_id: null,
      ended_at: null,
    });
  });

  it("when the same start is sent twice, then the repeat is harmless; with other content, 409", async () => {
    const body = { start: start("default/s2", "c1", { trace_id: "t1" }) };
    const first = unwrap(await client.POST("/call/start", { body }));
    expect(unwrap(await client.POST("/call/start", { body }))).toEqual(first);
    const { response, error } = await client.POST("/call/start", {
      body: { start: { ...body.start, op_name: "other" } },
    });
    expect(response.status).toBe(409);
    expect(error).toEqual({ detail: expect.stringContaining("c1") });
  });

  it("when the project's entity is not the key's, then 403", async () => {
    const { response, error } = await client.POST("/call/start", {
      body: { start: start("nobody/p", "x") },
    });
    expect(response.status).toBe(403);
    expect(error).toEqual({ detail: 'This API key may not act for entity "nobody".' });
  });

  it("when op_name is missing, then 422 locating it", async () => {
    const { response, error } = await client.POST("/call/start", {
      body: { start: { project_id: "default/s3", started_at: "2026-11-01T10:00:00Z" } } as never,
    });
    expect(response.status).toBe(422);
    expect(error).toEqual({
      detail: [{ loc: ["body", "start", "op_name"], msg: "Field required", type: "missing" }],
    });
  });
});

describe("endCall", () => {
  it("when an end arrives before its start, then the call stays invisible until the start merges in", async () => {
    const project = "default/e1";
    const summary = { usage: { m: { prompt_tokens: 3, completion_tokens: 4 } } };
    expect(
      await client.calls.end({ end: end(project, "late", { output: { answer: 42 }, summary }) }),
    ).toEqual({});
    expect((await query(project)).calls).toEqual([]);
    await client.calls.start({
      start: start(project, "late", { trace_id: "t", inputs: { q: "?" } }),
    });
    const [call] = (await query(project)).calls;
    expect(call).toEqual({
      id: "late",
      project_id: project,
      trace_id: "t",
      parent_id: null,
      op_name: "agent.step",
      display_name: null,
      started_at: "2026-11-01T10:00:00.000Z",
      ended_at: "2026-11-01T10:00:05.000Z",
      inputs: { q: "?" },
      output: { answer: 42 },
      exception: null,
      attributes: {},
      summary,
    });
  });
});

describe("upsertCallBatch", () => {
  it("when a batch mixes starts and ends, then it answers one entry per item in order", async () => {
    const project = "default/b1";
    const result = await client.calls.upsertBatch({
      batch: [
        { mode: "end", req: { end: end(project, "a") } },
        { mode: "start", req: { start: start(project, "a", { trace_id: "t" }) } },
        {
          mode: "start",
          req: { start: start(project, "b", { trace_id: "t", parent_id: "a" }) },
        },
      ],
    });
    expect(result.res).toEqual([{}, { id: "a", trace_id: "t" }, { id: "b", trace_id: "t" }]);
    expect((await query(project)).calls.map((c) => [c.id, c.ended_at !== null])).toEqual([
      ["a", true],
      ["b", false],
    ]);
  });

  it("when one start in a batch conflicts, then that item is reported and the others are stored", async () => {
    const project = "default/b2";
    await client.calls.start({ start: start(project, "taken", { trace_id: "t" }) });
    const result = await client.calls.upsertBatch({
      batch: [
        { mode: "start", req: { start: start(project, "fresh", { trace_id: "t" }) } },
        {
          mode: "start",
          req: { start: start(project, "taken", { trace_id: "t", op_name: "changed" }) },
        },
      ],
    });
    expect(result).toEqual({
      res: [{ id: "fresh", trace_id: "t" }, null],
      errors: [
        {
          index: 1,
          loc: ["body", "batch", 1, "req", "start"],
          msg: "Call taken already exists with different content",
          type: "conflict",
        },
      ],
    });
    expect((await query(project)).calls.map((c) => [c.id, c.op_name])).toEqual([
      ["fresh", "agent.step"],
      ["taken", "agent.step"],
    ]);
  });

  it("when the body itself is malformed, then 422 and nothing is stored", async () => {
    for (const body of [{}, { batch: [] }, { batch: "x" }]) {
      const { response, error } = await client.POST("/call/upsert_batch", { body: body as never });
      expect(response.status).toBe(422);
      expect((error as { detail: { loc: unknown[] }[] }).detail[0]!.loc[0]).toBe("body");
    }
  });

  it("when an item names a project of another entity, then 403 and nothing is stored", async () => {
    const { response } = await client.POST("/call/upsert_batch", {
      body: {
        batch: [
          { mode: "start", req: { start: start("default/b4", "mine") } },
          { mode: "start", req: { start: start("nobody/p", "theirs") } },
        ],
      },
    });
    expect(response.status).toBe(403);
    expect((await query("default/b4")).calls).toEqual([]);
  });
});

describe("queryCalls", () => {
  const project = "default/q";
  beforeAll(async () => {
    const batch = [
      start(project, "r1", { trace_id: "t1", started_at: "2026-11-01T10:00:00Z" }),
      start(project, "r1c", {
        trace_id: "t1",
        parent_id: "r1",
        op_name: "llm",
        started_at: "2026-11-01T10:00:01Z",
      }),
      start(project, "r2", { trace_id: "t2", started_at: "2026-11-02T10:00:00Z" }),
      start(project, "r2c", {
        trace_id: "t2",
        parent_id: "r2",
        op_name: "llm",
        started_at: "2026-11-02T10:00:01Z",
      }),
    ].map((s) => ({ mode: "start" as const, req: { start: s } }));
    await client.calls.upsertBatch({ batch });
  });

  it.each([
    ["a trace", { trace_ids: ["t2"] }, ["r2", "r2c"]],
    ["a parent", { parent_ids: ["r1"] }, ["r1c"]],
    ["an op name", { op_names: ["llm"] }, ["r1c", "r2c"]],
    ["call ids", { call_ids: ["r2", "r1"] }, ["r1", "r2"]],
    [
      "a time window",
      { started_after: "2026-11-01T10:00:01Z", started_before: "2026-11-02T10:00:01Z" },
      ["r1c", "r2"],
    ],
    ["trace roots only", { trace_roots_only: true }, ["r1", "r2"]],
  ])(
    "when filtering by %s, then only matching calls come back in start order",
    async (_, filter, ids) => {
      expect((await query(project, filter)).calls.map((c) => c.id)).toEqual(ids);
    },
  );

  it("when paging with limit and offset, then pages neither skip nor repeat", async () => {
    const first = await query(project, {}, { limit: 3 });
    const second = await query(project, {}, { limit: 3, offset: 3 });
    expect(first.has_more).toBe(true);
    expect(second.has_more).toBe(false);
    expect([...first.calls, ...second.calls].map((c) => c.id)).toEqual(["r1", "r1c", "r2", "r2c"]);
  });

  it("when another project is queried, then none of these calls come back", async () => {
    expect((await query("default/other")).calls).toEqual([]);
  });
});

describe("deleteCalls", () => {
  it("when a call is deleted, then its descendants go too, and a repeat deletes nothing", async () => {
    const project = "default/d1";
    const batch = [
      start(project, "root", { trace_id: "t" }),
      start(project, "kid", { trace_id: "t", parent_id: "root" }),
      start(project, "grandkid", { trace_id: "t", parent_id: "kid" }),
      start(project, "sibling", { trace_id: "t", parent_id: "root" }),
    ].map((s) => ({ mode: "start" as const, req: { start: s } }));
    await client.calls.upsertBatch({ batch });
    expect(await client.calls.delete({ project_id: project, call_ids: ["kid"] })).toEqual({
      num_deleted: 2,
    });
    expect((await query(project)).calls.map((c) => c.id)).toEqual(["root", "sibling"]);
    expect(await client.calls.delete({ project_id: project, call_ids: ["kid"] })).toEqual({
      num_deleted: 0,
    });
  });

  it("when the ids belong to another project, then nothing is deleted", async () => {
    await client.calls.start({ start: start("default/d2", "keep", { trace_id: "t" }) });
    expect(await client.calls.delete({ project_id: "default/d3", call_ids: ["keep"] })).toEqual({
      num_deleted: 0,
    });
    expect((await query("default/d2")).calls.map((c) => c.id)).toEqual(["keep"]);
  });
});

/** The same checks on each store: SQLite, and PostgreSQL when it answers. */
const STORES = [
  { store: "SQLite", postgres: undefined },
  { store: "PostgreSQL", postgres: { url: PG_URL } },
];

describe.each(STORES)("tolerant ingestion on $store", ({ store, postgres }) => {
  const skip = store === "PostgreSQL" && pgSkipReason !== null;
  let own: RunningServer;
  let api: ArborClient;
  beforeAll(async () => {
    if (skip) return;
    own = await startServer({}, postgres ? { postgres } : {});
    api = own.authorizedClient();
  });
  afterAll(() => (skip ? undefined : own.close()));

  const project = "default/tolerant";
  const rows = async () =>
    (await api.calls.query({ project_id: project, limit: 100 })).calls.map((c) => ({
      id: c.id,
      inputs: c.inputs,
      attributes: c.attributes,
      output: c.output,
      summary: c.summary,
    }));

  it.skipIf(skip)(
    "when free-form fields hold any JSON, malformed usage included, then the calls are stored as sent and answer 200",
    async () => {
      const odd = {
        inputs: "a bare string",
        attributes: [1, "two", null],
      };
      expect(
        await api.calls.start({ start: start(project, "free", { trace_id: "f", ...odd }) }),
      ).toEqual({ id: "free", trace_id: "f" });
      const summary = {
        usage: { "some-model": "oops", m: { prompt_tokens: "12", completion_tokens: 3 }, z: {} },
        note: [true],
      };
      expect(
        await api.calls.end({ end: end(project, "free", { output: 42, summary } as never) }),
      ).toEqual({});
      const { response, data } = await api.POST("/call/end", {
        body: { end: end(project, "free", { summary: "not even an object" as never }) },
      });
      expect([response.status, data]).toEqual([200, {}]);
      expect(await rows()).toEqual([
        { id: "free", ...odd, output: null, summary: "not even an object" },
      ]);
      await api.calls.end({ end: end(project, "free", { output: 42, summary } as never) });
      expect(await rows()).toEqual([{ id: "free", ...odd, output: 42, summary }]);
      // Only numbers count: m has one request and 3 completion tokens; the rest count nothing.
      expect(
        (await api.calls.usage({ project_id: project, call_ids: ["free"] })).call_usage,
      ).toEqual({
        free: {
          m: {
            requests: 1,
            prompt_tokens: 0,
            completion_tokens: 3,
            total_tokens: 3,
            cache_read_input_tokens: 0,
            cache_creation_input_tokens: 0,
            prompt_tokens_total_cost: null,
            completion_tokens_total_cost: null,
            cache_read_input_tokens_total_cost: null,
            cache_creation_input_tokens_total_cost: null,
          },
        },
      });
    },
  );

  it.skipIf(skip)(
    "when a structural field is bad, then /call/start and /call/end still answer 422 locating it",
    async () => {
      for (const [path, body, loc] of [
        ["/call/start", { start: start(project, "x", { started_at: "yesterday" }) }, "started_at"],
        ["/call/start", { start: start(project, "x", { id: "" }) }, "id"],
        ["/call/end", { end: end(project, "x", { ended_at: 5 }) }, "ended_at"],
        ["/call/end", { end: end("no-slash", "x") }, "project_id"],
      ] as const) {
        const { response, error } = await api.POST(path as "/call/start", { body: body as never });
        expect(response.status).toBe(422);
        expect((error as { detail: { loc: unknown[] }[] }).detail[0]!.loc.at(-1)).toBe(loc);
      }
    },
  );

  interface BadItem {
    name: string;
    item: unknown;
    /** Where the first error is, under `["body", "batch", index]`, and its type. */
    loc: (string | number)[];
    type: string;
  }

  const BAD_ITEMS: BadItem[] = [
    {
      name: "a start without op_name",
      item: {
        mode: "start",
        req: { start: { project_id: project, id: "b1", started_at: "2026-11-01T10:00:00Z" } },
      },
      loc: ["req", "start", "op_name"],
      type: "missing",
    },
    {
      name: "a start whose started_at is not a date-time",
      item: { mode: "start", req: { start: start(project, "b2", { started_at: "noon" }) } },
      loc: ["req", "start", "started_at"],
      type: "format",
    },
    {
      name: "an end whose project_id is not <entity>/<project>",
      item: { mode: "end", req: { end: end("nope", "b3") } },
      loc: ["req", "end", "project_id"],
      type: "string_pattern_mismatch",
    },
    {
      name: "an item with an unknown mode",
      item: { mode: "update", req: {} },
      loc: ["mode"],
      type: "enum",
    },
    { name: "an item that is not an object", item: "start", loc: [], type: "dict_type" },
    {
      name: "a start whose id holds a NUL",
      item: { mode: "start", req: { start: start(project, "nul\u0000") } },
      loc: ["req", "start", "id"],
      type: "value_error",
    },
  ];

  it.skipIf(skip).each(BAD_ITEMS)(
    "when one item of a batch is $name, then its index is reported and the others are stored",
    async ({ item, loc, type }) => {
      const p = `default/batch-${type}`;
      const result = await api.calls.upsertBatch({
        batch: [
          { mode: "start", req: { start: start(p, "before", { trace_id: "t", summary: 1 }) } },
          item as never,
          { mode: "end", req: { end: end(p, "before", { summary: { usage: { m: "x" } } }) } },
          {
            mode: "start",
            req: { start: start(p, "after", { trace_id: "t", parent_id: "before" }) },
          },
        ],
      });
      expect(result.res).toEqual([
        { id: "before", trace_id: "t" },
        null,
        {},
        { id: "after", trace_id: "t" },
      ]);
      expect(result.errors.length).toBeGreaterThan(0);
      expect(result.errors.every((e) => e.index === 1)).toBe(true);
      expect(result.errors[0]).toMatchObject({ loc: ["body", "batch", 1, ...loc], type });
      const calls = (await api.calls.query({ project_id: p })).calls;
      expect(calls.map((c) => [c.id, c.ended_at !== null])).toEqual(
        [
          ["after", false],
          ["before", true],
        ].sort(),
      );
    },
  );
});
