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

/** A call of a test tree: its own usage only (`summary.usage`, ADR 18); `getCallsUsage` sums the subtree. */
interface Node {
  id: string;
  parent?: string;
  usage?: Record<string, Record<string, unknown>>;
  ended?: boolean;
  started_at?: string;
}

/** The nodes as one upsert_batch: every start, then the ends. */
function batchOf(project: string, nodes: Node[], trace = "t") {
  const starts = nodes.map((n) => ({
    mode: "start" as const,
    req: {
      start: {
        project_id: project,
        id: n.id,
        trace_id: trace,
        parent_id: n.parent ?? null,
        op_name: "op",
        started_at: n.started_at ?? "2026-11-01T00:00:00Z",
      },
    },
  }));
  const ends = nodes
    .filter((n) => n.ended !== false)
    .map((n) => ({
      mode: "end" as const,
      req: {
        end: {
          project_id: project,
          id: n.id,
          ended_at: "2026-11-01T00:00:01Z",
          summary: n.usage ? { usage: n.usage } : {},
        },
      },
    }));
  return [...starts, ...ends];
}

/** Ingests the nodes with one upsert_batch. */
async function ingest(project: string, nodes: Node[], trace = "t") {
  await client.calls.upsertBatch({ batch: batchOf(project, nodes, trace) });
}

/** A full usage value; costs null unless priced. */
function usage(
  u: {
    requests: number;
    prompt: number;
    completion: number;
    total: number;
    cacheRead?: number;
    cacheCreation?: number;
  },
  costs: {
    prompt: number;
    completion: number;
    cacheRead?: number;
    cacheCreation?: number;
  } | null = null,
) {
  return {
    requests: u.requests,
    prompt_tokens: u.prompt,
    completion_tokens: u.completion,
    total_tokens: u.total,
    cache_read_input_tokens: u.cacheRead ?? 0,
    cache_creation_input_tokens: u.cacheCreation ?? 0,
    prompt_tokens_total_cost: costs ? expect.closeTo(costs.prompt, 9) : null,
    completion_tokens_total_cost: costs ? expect.closeTo(costs.completion, 9) : null,
    cache_read_input_tokens_total_cost: costs ? expect.closeTo(costs.cacheRead ?? 0, 9) : null,
    cache_creation_input_tokens_total_cost: costs
      ? expect.closeTo(costs.cacheCreation ?? 0, 9)
      : null,
  };
}

const threeLevels: Node[] = [
  { id: "root", usage: { m1: { prompt_tokens: 10, completion_tokens: 5 } } },
  { id: "child", parent: "root", usage: { m1: { prompt_tokens: 20, completion_tokens: 10 } } },
  {
    id: "grandchild",
    parent: "child",
    usage: { m1: { prompt_tokens: 1, completion_tokens: 1, total_tokens: 3 } },
  },
];

interface Case {
  name: string;
  nodes: Node[];
  ids: string[];
  expected: Record<string, unknown>;
  unfinished?: string[];
}

const cases: Case[] = [
  {
    name: "a three-level tree",
    nodes: threeLevels,
    ids: ["root"],
    expected: { root: { m1: usage({ requests: 3, prompt: 31, completion: 16, total: 48 }) } },
  },
  {
    name: "two models in one tree, with input/output tokens folded in",
    nodes: [
      { id: "root", usage: { m1: { prompt_tokens: 1, completion_tokens: 1 } } },
      { id: "child", parent: "root", usage: { m2: { input_tokens: 4, output_tokens: 6 } } },
      { id: "grandchild", parent: "child", usage: { m1: { prompt_tokens: 2, input_tokens: 3 } } },
    ],
    ids: ["root"],
    expected: {
      root: {
        m1: usage({ requests: 2, prompt: 6, completion: 1, total: 7 }),
        m2: usage({ requests: 1, prompt: 4, completion: 6, total: 10 }),
      },
    },
  },
  {
    name: "a malformed usage value, which is ignored",
    nodes: [
      { id: "root", usage: { m1: { prompt_tokens: "12", completion_tokens: 3 } } },
      { id: "child", parent: "root", usage: { m1: { prompt_tokens: 2, completion_tokens: [1] } } },
    ],
    ids: ["root"],
    expected: { root: { m1: usage({ requests: 2, prompt: 2, completion: 3, total: 5 }) } },
  },
  {
    name: "usage missing at the root",
    nodes: [
      { id: "root" },
      { id: "child", parent: "root", usage: { m1: { prompt_tokens: 1, completion_tokens: 2 } } },
    ],
    ids: ["root"],
    expected: { root: { m1: usage({ requests: 1, prompt: 1, completion: 2, total: 3 }) } },
  },
  {
    name: "usage missing in the middle",
    nodes: [
      { id: "root", usage: { m1: { prompt_tokens: 1, completion_tokens: 1 } } },
      { id: "child", parent: "root" },
      {
        id: "grandchild",
        parent: "child",
        usage: { m1: { prompt_tokens: 2, completion_tokens: 2 } },
      },
    ],
    ids: ["root"],
    expected: { root: { m1: usage({ requests: 2, prompt: 3, completion: 3, total: 6 }) } },
  },
  {
    name: "usage missing everywhere",
    nodes: [{ id: "root" }, { id: "child", parent: "root" }],
    ids: ["root"],
    expected: { root: {} },
  },
  {
    name: "a duplicate id, a non-root id and a missing id in one request",
    nodes: threeLevels,
    ids: ["root", "root", "child", "missing"],
    expected: {
      root: { m1: usage({ requests: 3, prompt: 31, completion: 16, total: 48 }) },
      child: { m1: usage({ requests: 2, prompt: 21, completion: 11, total: 33 }) },
      missing: {},
    },
  },
  {
    name: "an unfinished child",
    nodes: [
      { id: "root", usage: { m1: { prompt_tokens: 5, completion_tokens: 5 } } },
      { id: "child-b", parent: "root", ended: false },
      { id: "child-a", parent: "root", ended: false },
    ],
    ids: ["root"],
    expected: { root: { m1: usage({ requests: 1, prompt: 5, completion: 5, total: 10 }) } },
    unfinished: ["child-a", "child-b"],
  },
  {
    name: "cache-token fields and an explicit requests count",
    nodes: [
      {
        id: "root",
        usage: {
          m1: {
            requests: 4,
            prompt_tokens: 100,
            completion_tokens: 10,
            cache_read_input_tokens: 80,
            cache_creation_input_tokens: 20,
          },
        },
      },
      {
        id: "child",
        parent: "root",
        usage: { m1: { prompt_tokens: 1, completion_tokens: 1, cache_read_input_tokens: 1 } },
      },
    ],
    ids: ["root"],
    expected: {
      root: {
        m1: usage({
          requests: 5,
          prompt: 101,
          completion: 11,
          total: 112,
          cacheRead: 81,
          cacheCreation: 20,
        }),
      },
    },
  },
  {
    name: "a child whose parent does not exist, which is its own root",
    nodes: [
      { id: "orphan", parent: "ghost", usage: { m1: { prompt_tokens: 7, completion_tokens: 1 } } },
    ],
    ids: ["orphan", "ghost"],
    expected: {
      orphan: { m1: usage({ requests: 1, prompt: 7, completion: 1, total: 8 }) },
      ghost: {},
    },
  },
];

describe("getCallsUsage", () => {
  it.each(cases.map((c, i) => [c.name, c, i] as const))(
    "when %s, then the sums are exact",
    async (_, c, i) => {
      const project = `default/usage-${i}`;
      await ingest(project, c.nodes);
      const result = await client.calls.usage({ project_id: project, call_ids: c.ids });
      expect(result.call_usage).toEqual(c.expected);
      expect(result.unfinished_call_ids).toEqual(c.unfinished ?? []);
    },
  );

  it("when two traces are asked for in one request, then each root gets its own sums", async () => {
    const project = "default/two-traces";
    await ingest(
      project,
      [{ id: "a", usage: { m1: { prompt_tokens: 1, completion_tokens: 1 } } }],
      "trace-a",
    );
    await ingest(
      project,
      [
        { id: "b", usage: { m2: { prompt_tokens: 2, completion_tokens: 2 } } },
        { id: "b1", parent: "b", usage: { m2: { prompt_tokens: 3, completion_tokens: 3 } } },
      ],
      "trace-b",
    );
    const result = await client.calls.usage({ project_id: project, call_ids: ["a", "b"] });
    expect(result.call_usage).toEqual({
      a: { m1: usage({ requests: 1, prompt: 1, completion: 1, total: 2 }) },
      b: { m2: usage({ requests: 2, prompt: 5, completion: 5, total: 10 }) },
    });
  });

  it("when costs are asked for, then each call uses the newest price in effect at its start", async () => {
    const project = "default/costs";
    await server.store.prices.set({
      model: "priced",
      prompt_token_cost: 0.001,
      completion_token_cost: 0.002,
      effective_date: "2026-01-01T00:00:00Z",
    });
    await server.store.prices.set({
      model: "priced",
      prompt_token_cost: 0.01,
      completion_token_cost: 0.02,
      effective_date: "2026-06-01T00:00:00Z",
    });
    await ingest(project, [
      {
        id: "march",
        started_at: "2026-03-01T00:00:00Z",
        usage: { priced: { prompt_tokens: 10, completion_tokens: 10 } },
      },
      {
        id: "july",
        parent: "march",
        started_at: "2026-07-01T00:00:00Z",
        usage: { priced: { prompt_tokens: 10, completion_tokens: 10 } },
      },
    ]);
    const body = { project_id: project, call_ids: ["march"] };
    const priced = await client.calls.usage({ ...body, include_costs: true });
    expect(priced.call_usage.march).toEqual({
      priced: usage(
        { requests: 2, prompt: 20, completion: 20, total: 40 },
        { prompt: 0.11, completion: 0.22 },
      ),
    });
    const unpriced = unwrap(await client.POST("/calls/usage", { body }));
    expect(unpriced.call_usage.march).toEqual({
      priced: usage({ requests: 2, prompt: 20, completion: 20, total: 40 }),
    });
  });

  it("when the project has its own price, then it overrides the default, and unpriced models cost 0", async () => {
    const project = "default/override";
    await server.store.prices.set({
      model: "shared",
      prompt_token_cost: 0.001,
      completion_token_cost: 0.001,
      effective_date: "2026-01-01T00:00:00Z",
    });
    await server.store.prices.set({
      model: "shared",
      project_id: project,
      prompt_token_cost: 0.5,
      completion_token_cost: 0.25,
      effective_date: "2026-01-01T00:00:00Z",
    });
    await ingest(project, [
      {
        id: "r",
        usage: {
          shared: { prompt_tokens: 2, completion_tokens: 4 },
          free: { prompt_tokens: 1, completion_tokens: 1 },
        },
      },
    ]);
    const result = await client.calls.usage({
      project_id: project,
      call_ids: ["r"],
      include_costs: true,
    });
    expect(result.call_usage.r).toEqual({
      shared: usage(
        { requests: 1, prompt: 2, completion: 4, total: 6 },
        { prompt: 1, completion: 1 },
      ),
      free: usage(
        { requests: 1, prompt: 1, completion: 1, total: 2 },
        { prompt: 0, completion: 0 },
      ),
    });
  });

  it("when ids belong to another project, then they read as missing; another entity gets 403", async () => {
    await ingest("default/private", threeLevels);
    const other = await client.calls.usage({ project_id: "default/elsewhere", call_ids: ["root"] });
    expect(other).toEqual({ call_usage: { root: {} }, unfinished_call_ids: [] });
    const stranger = await server.newTenant("stranger");
    const { response, error } = await stranger.client.POST("/calls/usage", {
      body: { project_id: "default/private", call_ids: ["root"] },
    });
    expect(response.status).toBe(403);
    expect(error).toEqual({ detail: 'This API key may not act for entity "default".' });
  });

  it("when a trace holds more calls than limit, then 413 names the trace and the limit and asks for a larger one", async () => {
    const project = "default/limit";
    await ingest(project, threeLevels);
    const { response, error } = await client.POST("/calls/usage", {
      body: { project_id: project, call_ids: ["root"], limit: 2 },
    });
    expect(response.status).toBe(413);
    expect((error as { detail: string }).detail).toMatch(
      /Trace "t" alone holds 3 calls, more than the limit of 2 .* a larger limit/,
    );
    const ok = await client.POST("/calls/usage", {
      body: { project_id: project, call_ids: ["root"], limit: 3 },
    });
    expect(ok.response.status).toBe(200);
  });

  it("when a call is deleted, then it and its descendants read as missing", async () => {
    const project = "default/deleted";
    await ingest(project, threeLevels);
    expect(await client.calls.delete({ project_id: project, call_ids: ["child"] })).toEqual({
      num_deleted: 2,
    });
    const result = await client.calls.usage({ project_id: project, call_ids: ["root", "child"] });
    expect(result.call_usage).toEqual({
      root: { m1: usage({ requests: 1, prompt: 10, completion: 5, total: 15 }) },
      child: {},
    });
  });
});

describe("getCallsUsageByDay", () => {
  it("when chats are served in a project, then their recorded usage is summed on today's row for the model", async () => {
    const project = "default/daily-chat";
    const chat = server.authorizedClient({ project });
    let prompt = 0;
    let completion = 0;
    for (const content of ["Say hello", "Count to three"]) {
      const answer = await chat.chat.completions.create({
        model: "arbor/tiny-chat",
        messages: [{ role: "user", content }],
        max_tokens: 6,
      });
      prompt += answer.usage!.prompt_tokens;
      completion += answer.usage!.completion_tokens;
    }
    const today = new Date().toISOString().slice(0, 10);
    const result = await client.calls.usageByDay({ project_id: project });
    expect(result.end_date).toBe(today);
    expect(Date.parse(result.end_date) - Date.parse(result.start_date)).toBe(29 * 86_400_000);
    expect(result.daily_usage).toEqual({
      [today]: {
        "arbor/tiny-chat": usage({
          requests: 2,
          prompt,
          completion,
          total: prompt + completion,
        }),
      },
    });
  });

  it("when calls started on several days, then each day has its own sums and the range bounds them", async () => {
    const project = "default/daily-range";
    await ingest(
      project,
      [
        { id: "r", started_at: "2026-05-01T10:00:00Z", usage: { m: { prompt_tokens: 3 } } },
        {
          id: "k",
          parent: "r",
          started_at: "2026-05-02T10:00:00Z",
          usage: { m: { completion_tokens: 4 } },
        },
        { id: "late", started_at: "2026-05-09T10:00:00Z", usage: { m: { prompt_tokens: 99 } } },
      ],
      "days",
    );
    const result = await client.calls.usageByDay({
      project_id: project,
      start_date: "2026-05-01",
      end_date: "2026-05-08",
    });
    expect(result).toEqual({
      start_date: "2026-05-01",
      end_date: "2026-05-08",
      daily_usage: {
        "2026-05-01": { m: usage({ requests: 1, prompt: 3, completion: 0, total: 3 }) },
        "2026-05-02": { m: usage({ requests: 1, prompt: 0, completion: 4, total: 4 }) },
      },
    });
  });

  it.each([
    [{ start_date: "2026-05-09", end_date: "2026-05-08" }, "start_date"],
    [{ start_date: "2025-01-01", end_date: "2026-05-08" }, "start_date"],
    [{ end_date: "2026-02-30" }, "end_date"],
  ])("when the range is %j, then 422 names %s", async (range, field) => {
    const { response, error } = await client.POST("/calls/usage_by_day", {
      body: { project_id: "default/daily-range", ...range },
    });
    expect(response.status).toBe(422);
    expect(JSON.stringify(error)).toContain(field);
  });

  it("when another entity's project is asked for, then 403", async () => {
    const stranger = await server.newTenant("daily-stranger");
    await expect(
      stranger.client.calls.usageByDay({ project_id: "default/daily-range" }),
    ).rejects.toMatchObject({ status: 403 });
  });
});

/** The same checks on each store: SQLite, and PostgreSQL when it answers. */
const STORES = [
  { store: "SQLite", postgres: undefined },
  { store: "PostgreSQL", postgres: { url: PG_URL } },
];

/** Two traces of four calls: `ra` → `a1`, `a2` → `a3` (unfinished), `rb` → `b1` → `b2` → `b3`. */
const twoTraces: [string, Node[]][] = [
  [
    "ta",
    [
      { id: "ra", usage: { m1: { prompt_tokens: 1, completion_tokens: 1 } } },
      { id: "a1", parent: "ra", usage: { m1: { prompt_tokens: 2 } } },
      { id: "a2", parent: "ra", usage: { m2: { prompt_tokens: 3 } } },
      { id: "a3", parent: "a2", ended: false },
    ],
  ],
  [
    "tb",
    [
      { id: "rb", usage: { m1: { prompt_tokens: 10 } } },
      { id: "b1", parent: "rb", usage: { m1: { completion_tokens: 20 } } },
      { id: "b2", parent: "b1" },
      { id: "b3", parent: "b2", usage: { m2: { prompt_tokens: 30, total_tokens: 99 } } },
    ],
  ],
];

const ra = {
  m1: usage({ requests: 2, prompt: 3, completion: 1, total: 4 }),
  m2: usage({ requests: 1, prompt: 3, completion: 0, total: 3 }),
};
const rb = {
  m1: usage({ requests: 2, prompt: 10, completion: 20, total: 30 }),
  m2: usage({ requests: 1, prompt: 30, completion: 0, total: 99 }),
};

interface LimitCase {
  name: string;
  ids: string[];
  limit: number;
  /** The usage and unfinished ids, or the 413 detail expected. */
  expected: { call_usage: Record<string, unknown>; unfinished_call_ids: string[] } | RegExp;
}

const LIMIT_CASES: LimitCase[] = [
  ...[4, 5, 8].map((limit) => ({
    name: `two 4-call traces with limit ${limit}`,
    ids: ["ra", "rb"],
    limit,
    expected: { call_usage: { ra, rb }, unfinished_call_ids: ["a3"] },
  })),
  {
    name: "one 4-call trace with limit 3",
    ids: ["rb"],
    limit: 3,
    expected:
      /^Trace "tb" alone holds 4 calls, more than the limit of 3 .*ask again with a larger limit\.$/,
  },
  {
    name: "a root, its descendants and a duplicate with limit 4",
    ids: ["a2", "ra", "a3", "a2", "b3"],
    limit: 4,
    expected: {
      call_usage: {
        a2: { m2: usage({ requests: 1, prompt: 3, completion: 0, total: 3 }) },
        ra,
        a3: {},
        b3: { m2: usage({ requests: 1, prompt: 30, completion: 0, total: 99 }) },
      },
      unfinished_call_ids: ["a3"],
    },
  },
];

describe.each(STORES)("getCallsUsage's limit on $store", ({ store, postgres }) => {
  const skip = store === "PostgreSQL" && pgSkipReason !== null;
  let own: RunningServer;
  let api: ArborClient;
  const project = "default/limits";
  beforeAll(async () => {
    if (skip) return;
    own = await startServer({}, postgres ? { postgres } : {});
    api = own.authorizedClient();
    for (const [trace, nodes] of twoTraces) {
      const items = batchOf(project, nodes, trace);
      // Children before their parents: the order of arrival changes nothing.
      expect((await api.calls.upsertBatch({ batch: items.reverse() })).errors).toEqual([]);
    }
  });
  afterAll(() => (skip ? undefined : own.close()));

  it.skipIf(skip).each(LIMIT_CASES)(
    "when asked for $ids with $name, then the answer is whole or 413",
    async ({ ids, limit, expected }) => {
      const { response, data, error } = await api.POST("/calls/usage", {
        body: { project_id: project, call_ids: ids, limit },
      });
      if (expected instanceof RegExp) {
        expect(response.status).toBe(413);
        expect((error as { detail: string }).detail).toMatch(expected);
        return;
      }
      expect(response.status).toBe(200);
      expect(data).toEqual(expected);
    },
  );
});
