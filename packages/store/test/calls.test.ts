import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import {
  type CallBatchItem,
  ConflictError,
  type Json,
  LimitExceededError,
  MIGRATIONS,
  type ModelUsage,
  migrate,
  openStore,
  PostgresSql,
  SqliteSql,
} from "../src/index.ts";
import { describeBackends, PG_URL, unique } from "./helpers.ts";

interface SeedCall {
  id: string;
  parent?: string;
  trace?: string;
  usage?: Json;
  /** A whole summary, for malformed shapes. */
  summary?: Json;
  ended?: boolean;
  started_at?: string;
  op?: string;
}

const T0 = "2026-03-01T00:00:00.000Z";

/** Every number the usage endpoint reports for one model; unspecified ones are 0 / null. */
function usage(partial: Partial<ModelUsage>): ModelUsage {
  return {
    requests: 0,
    prompt_tokens: 0,
    completion_tokens: 0,
    total_tokens: 0,
    cache_read_input_tokens: 0,
    cache_creation_input_tokens: 0,
    prompt_tokens_total_cost: null,
    completion_tokens_total_cost: null,
    cache_read_input_tokens_total_cost: null,
    cache_creation_input_tokens_total_cost: null,
    ...partial,
  };
}

function batch(project: string, calls: SeedCall[]): CallBatchItem[] {
  const items: CallBatchItem[] = [];
  for (const c of calls) {
    items.push({
      mode: "start",
      start: {
        project_id: project,
        id: c.id,
        trace_id: c.trace ?? "trace-1",
        parent_id: c.parent ?? null,
        op_name: c.op ?? "op",
        started_at: c.started_at ?? T0,
        inputs: { q: c.id },
      },
    });
    if (c.ended !== false) {
      items.push({
        mode: "end",
        end: {
          project_id: project,
          id: c.id,
          ended_at: "2026-03-01T00:01:00.000Z",
          output: "ok",
          summary: c.summary ?? (c.usage === undefined ? {} : { usage: c.usage }),
        },
      });
    }
  }
  return items;
}

/** The three-level, two-model tree most cases use. */
const TREE: SeedCall[] = [
  { id: "root", usage: { A: { prompt_tokens: 10, completion_tokens: 5 } } },
  {
    id: "child1",
    parent: "root",
    usage: {
      A: { input_tokens: 3, output_tokens: 2, total_tokens: 0 },
      B: { prompt_tokens: 7, completion_tokens: 1, total_tokens: 100 },
    },
  },
  {
    id: "grandchild",
    parent: "child1",
    usage: {
      A: {
        prompt_tokens: 1,
        completion_tokens: 1,
        requests: 2,
        cache_read_input_tokens: 4,
        cache_creation_input_tokens: 6,
      },
    },
  },
  { id: "child2", parent: "root", ended: false },
];

interface UsageCase {
  name: string;
  calls: SeedCall[];
  ids: string[];
  expected: Record<string, Record<string, ModelUsage>>;
  unfinished?: string[];
}

const USAGE_CASES: UsageCase[] = [
  {
    name: "a three-level tree with two models sums every descendant per model",
    calls: TREE,
    ids: ["root"],
    expected: {
      root: {
        A: usage({
          requests: 4,
          prompt_tokens: 14,
          completion_tokens: 8,
          total_tokens: 22,
          cache_read_input_tokens: 4,
          cache_creation_input_tokens: 6,
        }),
        B: usage({ requests: 1, prompt_tokens: 7, completion_tokens: 1, total_tokens: 100 }),
      },
    },
    unfinished: ["child2"],
  },
  {
    name: "a non-root id counts only its own subtree",
    calls: TREE,
    ids: ["child1"],
    expected: {
      child1: {
        A: usage({
          requests: 3,
          prompt_tokens: 4,
          completion_tokens: 3,
          total_tokens: 7,
          cache_read_input_tokens: 4,
          cache_creation_input_tokens: 6,
        }),
        B: usage({ requests: 1, prompt_tokens: 7, completion_tokens: 1, total_tokens: 100 }),
      },
    },
    unfinished: [],
  },
  {
    name: "duplicate, non-root and missing ids in one request each get one key",
    calls: TREE,
    ids: ["grandchild", "root", "grandchild", "missing"],
    expected: {
      grandchild: {
        A: usage({
          requests: 2,
          prompt_tokens: 1,
          completion_tokens: 1,
          total_tokens: 2,
          cache_read_input_tokens: 4,
          cache_creation_input_tokens: 6,
        }),
      },
      root: {
        A: usage({
          requests: 4,
          prompt_tokens: 14,
          completion_tokens: 8,
          total_tokens: 22,
          cache_read_input_tokens: 4,
          cache_creation_input_tokens: 6,
        }),
        B: usage({ requests: 1, prompt_tokens: 7, completion_tokens: 1, total_tokens: 100 }),
      },
      missing: {},
    },
    unfinished: ["child2"],
  },
  {
    name: "malformed usage values are ignored, not fatal",
    calls: [
      {
        id: "r",
        usage: {
          A: { prompt_tokens: "10", completion_tokens: 5, requests: "x", total_tokens: null },
        },
      },
      {
        id: "c1",
        parent: "r",
        usage: { A: 7, B: [1, 2], C: { prompt_tokens: true, completion_tokens: { n: 1 } } },
      },
      { id: "c2", parent: "r", summary: { usage: "garbage" } },
      { id: "c3", parent: "r", summary: { usage: [1, 2, 3] } },
      { id: "c4", parent: "r", summary: { other: 1 } },
    ],
    ids: ["r"],
    // C is left with only zeros: dropped, its default request with it.
    expected: { r: { A: usage({ requests: 1, completion_tokens: 5, total_tokens: 5 }) } },
  },
  {
    name: "usage missing at the root and the middle still reaches the root from the leaf",
    calls: [
      { id: "r" },
      { id: "m", parent: "r" },
      {
        id: "leaf",
        parent: "m",
        usage: { A: { prompt_tokens: 2, completion_tokens: 3, total_tokens: 6 } },
      },
    ],
    ids: ["r", "m"],
    expected: {
      r: { A: usage({ requests: 1, prompt_tokens: 2, completion_tokens: 3, total_tokens: 6 }) },
      m: { A: usage({ requests: 1, prompt_tokens: 2, completion_tokens: 3, total_tokens: 6 }) },
    },
  },
  {
    name: "usage missing everywhere gives an empty object",
    calls: [{ id: "r" }, { id: "c", parent: "r" }],
    ids: ["r"],
    expected: { r: {} },
  },
  {
    name: "two traces are aggregated separately",
    calls: [
      { id: "r1", trace: "t1", usage: { A: { prompt_tokens: 1, completion_tokens: 1 } } },
      {
        id: "c1",
        trace: "t1",
        parent: "r1",
        usage: { A: { prompt_tokens: 1, completion_tokens: 1 } },
      },
      { id: "r2", trace: "t2", usage: { A: { prompt_tokens: 5, completion_tokens: 5 } } },
    ],
    ids: ["r1", "r2"],
    expected: {
      r1: { A: usage({ requests: 2, prompt_tokens: 2, completion_tokens: 2, total_tokens: 4 }) },
      r2: { A: usage({ requests: 1, prompt_tokens: 5, completion_tokens: 5, total_tokens: 10 }) },
    },
  },
  {
    name: "an orphan child (its parent does not exist) is its own root and belongs to no other tree",
    calls: [
      { id: "r", usage: { A: { prompt_tokens: 1, completion_tokens: 0 } } },
      { id: "orphan", parent: "ghost", usage: { A: { prompt_tokens: 9, completion_tokens: 1 } } },
    ],
    ids: ["orphan", "r", "ghost"],
    expected: {
      orphan: {
        A: usage({ requests: 1, prompt_tokens: 9, completion_tokens: 1, total_tokens: 10 }),
      },
      r: { A: usage({ requests: 1, prompt_tokens: 1, total_tokens: 1 }) },
      ghost: {},
    },
  },
  {
    name: "unfinished children are listed sorted, whichever root reads them",
    calls: [
      { id: "r", ended: false },
      { id: "z", parent: "r", ended: false },
      { id: "b", parent: "r", ended: false, usage: { A: {} } },
      { id: "done", parent: "r" },
    ],
    ids: ["r"],
    expected: { r: {} },
    unfinished: ["b", "r", "z"],
  },
];

describeBackends("calls ingestion", (ctx) => {
  const start = (project: string, id: string, extra: Record<string, unknown> = {}) => ({
    project_id: project,
    id,
    trace_id: "t",
    op_name: "op",
    started_at: T0,
    inputs: { a: 1, b: [1, 2] },
    ...extra,
  });

  it("when a start then an end arrive, then the call merges both", async () => {
    const p = unique("ent/proj");
    expect(await ctx.store.calls.startCall(start(p, "c1"))).toEqual({ id: "c1", trace_id: "t" });
    await ctx.store.calls.endCall({
      project_id: p,
      id: "c1",
      ended_at: "2026-03-01T00:00:05Z",
      output: { x: 1 },
      summary: { usage: {} },
    });
    expect(await ctx.store.calls.getCall(p, "c1")).toMatchObject({
      id: "c1",
      trace_id: "t",
      started_at: T0,
      ended_at: "2026-03-01T00:00:05.000Z",
      inputs: { a: 1, b: [1, 2] },
      output: { x: 1 },
      summary: { usage: {} },
      deleted_at: null,
    });
  });

  it("when an end arrives first, then it is invisible until its start arrives", async () => {
    const p = unique("ent/proj");
    await ctx.store.calls.endCall({
      project_id: p,
      id: "early",
      ended_at: T0,
      output: "done",
      summary: { usage: { A: { prompt_tokens: 1 } } },
    });
    expect(await ctx.store.calls.getCall(p, "early")).toBeUndefined();
    expect(await ctx.store.calls.queryCalls(p)).toEqual([]);
    expect((await ctx.store.calls.callUsage(p, ["early"])).call_usage).toEqual({ early: {} });
    await ctx.store.calls.startCall(start(p, "early"));
    expect(await ctx.store.calls.getCall(p, "early")).toMatchObject({
      output: "done",
      ended_at: T0,
    });
    expect((await ctx.store.calls.callUsage(p, ["early"])).call_usage.early?.A?.prompt_tokens).toBe(
      1,
    );
  });

  it("when a start repeats, then identical content is idempotent and different content conflicts", async () => {
    const p = unique("ent/proj");
    await ctx.store.calls.startCall(start(p, "s"));
    // Same content, keys in another order.
    await ctx.store.calls.startCall({
      inputs: { b: [1, 2], a: 1 },
      started_at: T0,
      op_name: "op",
      trace_id: "t",
      id: "s",
      project_id: p,
    });
    await expect(
      ctx.store.calls.startCall(start(p, "s", { op_name: "other" })),
    ).rejects.toBeInstanceOf(ConflictError);
    const [refused] = await ctx.store.calls.upsertBatch([
      { mode: "start", start: start(p, "s", { inputs: {} }) },
    ]);
    expect(refused).toMatchObject({ ok: false, error: expect.any(ConflictError) });
    expect((await ctx.store.calls.getCall(p, "s"))?.op_name).toBe("op");
  });

  it("when a start without trace_id is retried, then it is idempotent and keeps the first trace", async () => {
    const p = unique("ent/proj");
    const input = { project_id: p, id: "no-trace", op_name: "op", started_at: T0 };
    const first = await ctx.store.calls.startCall(input);
    const again = await ctx.store.calls.startCall(input);
    expect(again).toEqual(first);
    const [batched] = await ctx.store.calls.upsertBatch([{ mode: "start", req: { start: input } }]);
    expect(batched).toEqual({ ok: true, ...first });
    const twice = (await ctx.store.calls.upsertBatch([
      { mode: "start", start: { ...input, id: "fresh" } },
      { mode: "start", start: { ...input, id: "fresh" } },
    ])) as { trace_id: string }[];
    expect(twice[0]?.trace_id).toBe(twice[1]?.trace_id);
    expect((await ctx.store.calls.getCall(p, "fresh"))?.trace_id).toBe(twice[0]?.trace_id);
    expect((await ctx.store.calls.getCall(p, "no-trace"))?.trace_id).toBe(first.trace_id);
  });

  it("when a batch holds thousands of items, then all land in one transaction; a refused item leaves the others stored", async () => {
    const p = unique("ent/proj");
    const calls: SeedCall[] = Array.from({ length: 3000 }, (_, i) => ({
      id: `b${i}`,
      parent: i === 0 ? undefined : `b${Math.floor((i - 1) / 4)}`,
      usage: { A: { prompt_tokens: 1, completion_tokens: 1 } },
    }));
    const results = await ctx.store.calls.upsertBatch(batch(p, calls));
    expect(results).toHaveLength(6000);
    expect(results.every((r) => r.ok)).toBe(true);
    const result = await ctx.store.calls.callUsage(p, ["b0"]);
    expect(result.call_usage.b0?.A).toEqual(
      usage({ requests: 3000, prompt_tokens: 3000, completion_tokens: 3000, total_tokens: 6000 }),
    );

    const bad = batch(p, [{ id: "new1" }, { id: "new2" }]);
    bad.push(
      {
        mode: "start",
        start: { project_id: p, id: "b5", trace_id: "other", op_name: "x", started_at: T0 },
      },
      { mode: "start", start: { project_id: p, id: "new3", op_name: "x", started_at: "never" } },
      { mode: "end", end: { project_id: p, id: "nul\u0000", ended_at: T0 } },
    );
    const outcome = await ctx.store.calls.upsertBatch(bad);
    expect(outcome.map((r) => r.ok)).toEqual([true, true, true, true, false, false, false]);
    expect(outcome[4]).toMatchObject({ error: expect.any(ConflictError) });
    expect(outcome[5]).toMatchObject({
      error: expect.objectContaining({ kind: "invalid", param: "start.started_at" }),
    });
    expect(outcome[6]).toMatchObject({
      error: expect.objectContaining({ kind: "invalid", param: "end.id" }),
    });
    expect(await ctx.store.calls.getCall(p, "new1")).toMatchObject({
      ended_at: expect.any(String),
    });
    expect((await ctx.store.calls.getCall(p, "b5"))?.trace_id).toBe("trace-1");

    const twice = await ctx.store.calls.upsertBatch([
      { mode: "start" as const, start: start(p, "dup") },
      { mode: "start" as const, start: start(p, "dup", { op_name: "changed" }) },
    ]);
    expect(twice[0]).toEqual({ ok: true, id: "dup", trace_id: "t" });
    expect(twice[1]).toMatchObject({ ok: false, error: expect.any(ConflictError) });
    expect((await ctx.store.calls.getCall(p, "dup"))?.op_name).toBe("op");
  });

  it("when overlapping batches arrive at once on separate handles, then none deadlocks and all land", async () => {
    const p = unique("ent/proj");
    const calls: SeedCall[] = Array.from({ length: 600 }, (_, i) => ({
      id: `o${i}`,
      usage: { A: { prompt_tokens: 1 } },
    }));
    const other = await ctx.openAnother();
    const forward = batch(p, calls);
    const backward = batch(p, [...calls].reverse());
    await Promise.all([
      ctx.store.calls.upsertBatch(forward),
      other.calls.upsertBatch(backward),
      ctx.store.calls.upsertBatch(backward),
      other.calls.upsertBatch(forward),
    ]);
    expect(await ctx.store.calls.queryCalls(p, {}, 1000)).toHaveLength(600);
  });

  it("when calls are queried, then every filter narrows the visible calls", async () => {
    const p = unique("ent/proj");
    await ctx.store.calls.upsertBatch(
      batch(p, [
        { id: "r1", trace: "t1", op: "agent", started_at: "2026-03-01T00:00:00Z" },
        { id: "c1", trace: "t1", parent: "r1", op: "llm", started_at: "2026-03-01T00:00:01Z" },
        { id: "c2", trace: "t1", parent: "r1", op: "llm", started_at: "2026-03-01T00:00:02Z" },
        { id: "r2", trace: "t2", op: "agent", started_at: "2026-03-01T00:00:03Z" },
      ]),
    );
    const ids = async (
      filter: Parameters<typeof ctx.store.calls.queryCalls>[1],
      limit?: number,
      offset?: number,
    ) => (await ctx.store.calls.queryCalls(p, filter, limit, offset)).map((c) => c.id);
    expect(await ids({})).toEqual(["r1", "c1", "c2", "r2"]);
    expect(await ids({ trace_ids: ["t2"] })).toEqual(["r2"]);
    expect(await ids({ call_ids: ["c2", "r1", "nope"] })).toEqual(["r1", "c2"]);
    expect(await ids({ parent_ids: ["r1"] })).toEqual(["c1", "c2"]);
    expect(await ids({ op_names: ["agent"] })).toEqual(["r1", "r2"]);
    expect(await ids({ trace_roots_only: true })).toEqual(["r1", "r2"]);
    expect(
      await ids({ started_after: "2026-03-01T00:00:01Z", started_before: "2026-03-01T00:00:03Z" }),
    ).toEqual(["c1", "c2"]);
    expect(await ids({ trace_ids: [] })).toEqual([]);
    expect(await ids({}, 2, 1)).toEqual(["c1", "c2"]);
    expect(await ctx.store.calls.queryCalls(unique("ent/other"))).toEqual([]);
  });

  it("when calls are deleted, then their descendants go too and the count says how many", async () => {
    const p = unique("ent/proj");
    await ctx.store.calls.upsertBatch(batch(p, TREE));
    const q = unique("ent/proj");
    await ctx.store.calls.upsertBatch(batch(q, TREE));
    expect(await ctx.store.calls.deleteCalls(p, ["child1", "nope"])).toBe(2);
    expect(await ctx.store.calls.deleteCalls(p, ["child1"])).toBe(0);
    expect((await ctx.store.calls.queryCalls(p)).map((c) => c.id)).toEqual(["child2", "root"]);
    const result = await ctx.store.calls.callUsage(p, ["root", "child1", "grandchild"]);
    expect(result.call_usage).toEqual({
      root: {
        A: usage({ requests: 1, prompt_tokens: 10, completion_tokens: 5, total_tokens: 15 }),
      },
      child1: {},
      grandchild: {},
    });
    // The other project is untouched.
    expect(await ctx.store.calls.queryCalls(q)).toHaveLength(4);
    expect(await ctx.store.calls.deleteCalls(p, ["root"])).toBe(2);
    expect(await ctx.store.calls.queryCalls(p)).toEqual([]);
  });
});

describeBackends("callUsage", (ctx) => {
  describe.each(USAGE_CASES)("$name", (c) => {
    it("then the usage and unfinished ids match", async () => {
      const p = unique("ent/proj");
      await ctx.store.calls.upsertBatch(batch(p, c.calls));
      const result = await ctx.store.calls.callUsage(p, c.ids);
      expect(result.call_usage).toEqual(c.expected);
      if (c.unfinished) expect(result.unfinished_call_ids).toEqual(c.unfinished);
    });
  });

  it("when ids belong to another project, then they read as missing both ways", async () => {
    const p = unique("ent/proj");
    const q = unique("ent/proj");
    await ctx.store.calls.upsertBatch(batch(p, TREE));
    // A call in q whose parent id names p's root must not join p's tree.
    await ctx.store.calls.upsertBatch(
      batch(q, [{ id: "intruder", parent: "root", usage: { A: { prompt_tokens: 1000 } } }]),
    );
    const foreign = await ctx.store.calls.callUsage(q, ["root", "child1"]);
    expect(foreign).toEqual({ call_usage: { root: {}, child1: {} }, unfinished_call_ids: [] });
    const own = await ctx.store.calls.callUsage(p, ["root"]);
    expect(own.call_usage.root?.A?.prompt_tokens).toBe(14);
  });

  it("when the trees hold more calls than the limit, then LimitExceededError says how many", async () => {
    const p = unique("ent/proj");
    await ctx.store.calls.upsertBatch(batch(p, TREE));
    const err = await ctx.store.calls.callUsage(p, ["root"], { limit: 3 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(LimitExceededError);
    expect(err).toMatchObject({ matched: 4, limit: 3 });
    expect((err as Error).message).toContain("4");
    const ok = await ctx.store.calls.callUsage(p, ["root"], { limit: 4 });
    expect(ok.call_usage.root?.A?.requests).toBe(4);
  });

  it("when costs are asked, then each call is priced with the newest price in effect at its start", async () => {
    const model = unique("model");
    const cheap = unique("cheap");
    const unpriced = unique("unpriced");
    const p = unique("ent/proj");
    const override = unique("ent/override");
    await ctx.store.prices.set({
      model,
      prompt_token_cost: 1,
      completion_token_cost: 2,
      cache_read_input_token_cost: 0.5,
      effective_date: "2026-01-01T00:00:00Z",
    });
    await ctx.store.prices.set({
      model,
      prompt_token_cost: 10,
      completion_token_cost: 20,
      cache_creation_input_token_cost: 3,
      effective_date: "2026-06-01T00:00:00Z",
    });
    // The project's own price overrides the defaults even though it is older.
    await ctx.store.prices.set({
      model,
      project_id: override,
      prompt_token_cost: 0.1,
      completion_token_cost: 0.2,
      effective_date: "2025-01-01T00:00:00Z",
    });
    await ctx.store.prices.set({
      model: cheap,
      prompt_token_cost: 0.001,
      completion_token_cost: 0.002,
      effective_date: "2026-07-01T00:00:00Z",
    });

    const calls: SeedCall[] = [
      {
        id: "r",
        started_at: "2026-03-01T00:00:00Z",
        usage: {
          [model]: { prompt_tokens: 100, completion_tokens: 10, cache_read_input_tokens: 4 },
        },
      },
      {
        id: "late",
        parent: "r",
        started_at: "2026-07-01T00:00:00Z",
        usage: {
          [model]: { prompt_tokens: 1, completion_tokens: 1, cache_creation_input_tokens: 2 },
          [unpriced]: { prompt_tokens: 5 },
        },
      },
      // Priced from 2026-07-01 on only: this call started before, so it costs 0.
      {
        id: "early",
        parent: "r",
        started_at: "2026-06-15T00:00:00Z",
        usage: { [cheap]: { prompt_tokens: 1000 } },
      },
    ];
    await ctx.store.calls.upsertBatch(batch(p, calls));
    await ctx.store.calls.upsertBatch(batch(override, calls));

    const priced = await ctx.store.calls.callUsage(p, ["r"], { includeCosts: true });
    const m = priced.call_usage.r?.[model];
    expect(m?.prompt_tokens_total_cost).toBeCloseTo(100 * 1 + 1 * 10);
    expect(m?.completion_tokens_total_cost).toBeCloseTo(10 * 2 + 1 * 20);
    expect(m?.cache_read_input_tokens_total_cost).toBeCloseTo(4 * 0.5);
    expect(m?.cache_creation_input_tokens_total_cost).toBeCloseTo(2 * 3);
    expect(priced.call_usage.r?.[unpriced]).toEqual(
      usage({
        requests: 1,
        prompt_tokens: 5,
        total_tokens: 5,
        prompt_tokens_total_cost: 0,
        completion_tokens_total_cost: 0,
        cache_read_input_tokens_total_cost: 0,
        cache_creation_input_tokens_total_cost: 0,
      }),
    );
    expect(priced.call_usage.r?.[cheap]?.prompt_tokens_total_cost).toBe(0);

    const overridden = await ctx.store.calls.callUsage(override, ["r"], { includeCosts: true });
    expect(overridden.call_usage.r?.[model]?.prompt_tokens_total_cost).toBeCloseTo(101 * 0.1);
    expect(overridden.call_usage.r?.[model]?.completion_tokens_total_cost).toBeCloseTo(11 * 0.2);
    expect(overridden.call_usage.r?.[model]?.cache_read_input_tokens_total_cost).toBe(0);

    const unpricedView = await ctx.store.calls.callUsage(p, ["r"]);
    expect(unpricedView.call_usage.r?.[model]?.prompt_tokens_total_cost).toBeNull();
  });
});

describeBackends("calls usage by day", (ctx) => {
  const DAYS: SeedCall[] = [
    // The first day: a root and its child, each counted for its own usage only.
    { id: "a", started_at: "2026-03-01T00:00:00Z", usage: { M: { prompt_tokens: 10 } } },
    {
      id: "a1",
      parent: "a",
      started_at: "2026-03-01T23:59:59.999Z",
      usage: { M: { prompt_tokens: 1, completion_tokens: 2 }, N: { completion_tokens: 7 } },
    },
    // The next day (UTC): a new day, whatever the offset it was sent with.
    {
      id: "b",
      trace: "t2",
      started_at: "2026-03-02T01:00:00+02:00",
      usage: { M: { prompt_tokens: 100 } },
    },
    {
      id: "c",
      trace: "t3",
      started_at: "2026-03-02T12:00:00Z",
      usage: { M: { completion_tokens: 4 } },
    },
    // Outside the range asked, on either side.
    {
      id: "d",
      trace: "t4",
      started_at: "2026-02-28T23:59:59Z",
      usage: { M: { prompt_tokens: 1000 } },
    },
    {
      id: "e",
      trace: "t5",
      started_at: "2026-03-04T00:00:00Z",
      usage: { M: { prompt_tokens: 1000 } },
    },
    { id: "f", trace: "t6", started_at: "2026-03-03T08:00:00Z", ended: false },
  ];

  it("when calls span days, then each is summed once on its UTC start day, per model, within the range", async () => {
    const p = unique("ent/proj");
    await ctx.store.calls.upsertBatch(batch(p, DAYS));
    const days = await ctx.store.calls.usageByDay(p, "2026-03-01", "2026-03-03");
    expect(Object.keys(days)).toEqual(["2026-03-01", "2026-03-02"]);
    // "2026-03-02T01:00:00+02:00" (b) is 2026-03-01T23:00Z: it belongs to the first day.
    expect(days["2026-03-01"]).toEqual({
      M: usage({ requests: 3, prompt_tokens: 111, completion_tokens: 2, total_tokens: 113 }),
      N: usage({ requests: 1, completion_tokens: 7, total_tokens: 7 }),
    });
    expect(days["2026-03-02"]).toEqual({
      M: usage({ requests: 1, completion_tokens: 4, total_tokens: 4 }),
    });
  });

  it("when calls are deleted (with their descendants) or of another project, then they are not counted", async () => {
    const p = unique("ent/proj");
    await ctx.store.calls.upsertBatch(batch(p, DAYS));
    await ctx.store.calls.upsertBatch(batch(unique("ent/other"), DAYS));
    await ctx.store.calls.deleteCalls(p, ["a"]);
    const days = await ctx.store.calls.usageByDay(p, "2026-03-01", "2026-03-01");
    expect(days).toEqual({
      "2026-03-01": { M: usage({ requests: 1, prompt_tokens: 100, total_tokens: 100 }) },
    });
  });

  it("when costs are asked, then each call is priced at its start", async () => {
    const model = unique("model");
    const p = unique("ent/proj");
    await ctx.store.prices.set({
      model,
      prompt_token_cost: 2,
      completion_token_cost: 3,
      effective_date: "2026-01-01T00:00:00Z",
    });
    await ctx.store.calls.upsertBatch(
      batch(p, [
        {
          id: "x",
          started_at: "2026-03-05T10:00:00Z",
          usage: { [model]: { prompt_tokens: 5, completion_tokens: 1 } },
        },
      ]),
    );
    const days = await ctx.store.calls.usageByDay(p, "2026-03-05", "2026-03-05", {
      includeCosts: true,
    });
    expect(days["2026-03-05"]?.[model]).toMatchObject({
      prompt_tokens_total_cost: 10,
      completion_tokens_total_cost: 3,
    });
  });
});

describeBackends("prices", (ctx) => {
  it("when prices are set, listed and deleted, then defaults and project rows stay apart", async () => {
    const model = unique("model");
    const a = await ctx.store.prices.set({
      model,
      prompt_token_cost: 1,
      completion_token_cost: 2,
      effective_date: "2026-01-01",
    });
    const again = await ctx.store.prices.set({
      model,
      prompt_token_cost: 3,
      completion_token_cost: 4,
      effective_date: "2026-01-01T00:00:00.000Z",
    });
    expect(again.id).toBe(a.id);
    const own = await ctx.store.prices.set({
      model,
      project_id: "e/p",
      prompt_token_cost: 5,
      completion_token_cost: 6,
      effective_date: "2026-01-01",
    });
    expect((await ctx.store.prices.list({ model })).map((x) => x.prompt_token_cost)).toEqual([3]);
    expect(
      (await ctx.store.prices.list({ model, project_id: "e/p" })).map((x) => x.id).sort(),
    ).toEqual([a.id, own.id].sort());
    await expect(ctx.store.prices.delete("e/other", own.id)).rejects.toThrow();
    await ctx.store.prices.delete("e/p", own.id);
    await ctx.store.prices.delete(null, a.id);
    expect(await ctx.store.prices.list({ model, project_id: "e/p" })).toEqual([]);
  });
});

/** Two traces of four calls each: `ra` → `a1`, `a2` → `a3`, and `rb` → `b1` → `b2` → `b3`. */
const TWO_TRACES: SeedCall[] = [
  { id: "ra", trace: "ta", usage: { A: { prompt_tokens: 1, completion_tokens: 1 } } },
  { id: "a1", trace: "ta", parent: "ra", usage: { A: { prompt_tokens: 2 } } },
  { id: "a2", trace: "ta", parent: "ra", usage: { B: { prompt_tokens: 3 } } },
  { id: "a3", trace: "ta", parent: "a2", ended: false },
  { id: "rb", trace: "tb", usage: { A: { prompt_tokens: 10 } } },
  { id: "b1", trace: "tb", parent: "rb", usage: { A: { completion_tokens: 20 } } },
  { id: "b2", trace: "tb", parent: "b1" },
  { id: "b3", trace: "tb", parent: "b2", usage: { B: { prompt_tokens: 30, total_tokens: 99 } } },
];

const TWO_TRACES_USAGE = {
  ra: {
    A: usage({ requests: 2, prompt_tokens: 3, completion_tokens: 1, total_tokens: 4 }),
    B: usage({ requests: 1, prompt_tokens: 3, total_tokens: 3 }),
  },
  rb: {
    A: usage({ requests: 2, prompt_tokens: 10, completion_tokens: 20, total_tokens: 30 }),
    B: usage({ requests: 1, prompt_tokens: 30, total_tokens: 99 }),
  },
};

interface BatchCase {
  name: string;
  calls: SeedCall[];
  ids: string[];
  limit: number;
  /** The usage expected, or the trace that alone does not fit. */
  expected: Record<string, Record<string, ModelUsage>> | { tooLarge: string; matched: number };
  unfinished?: string[];
}

const BATCH_CASES: BatchCase[] = [
  ...[4, 5, 8, 10000].map((limit) => ({
    name: `two 4-call traces with limit ${limit} are answered in full`,
    calls: TWO_TRACES,
    ids: ["ra", "rb"],
    limit,
    expected: TWO_TRACES_USAGE,
    unfinished: ["a3"],
  })),
  {
    name: "a 4-call trace with limit 3 does not fit",
    calls: TWO_TRACES,
    ids: ["rb"],
    limit: 3,
    expected: { tooLarge: "tb", matched: 4 },
  },
  {
    name: "a root and its descendants in one request count their trace once",
    calls: TWO_TRACES,
    ids: ["a2", "ra", "a3", "ra", "b2"],
    limit: 4,
    expected: {
      a2: { B: usage({ requests: 1, prompt_tokens: 3, total_tokens: 3 }) },
      ra: TWO_TRACES_USAGE.ra,
      a3: {},
      b2: { B: usage({ requests: 1, prompt_tokens: 30, total_tokens: 99 }) },
    },
    unfinished: ["a3"],
  },
  {
    name: "a child in another trace is its parent's descendant, and counts toward the batch",
    calls: [
      { id: "r", trace: "t1", usage: { A: { prompt_tokens: 1 } } },
      { id: "r1", trace: "t1", parent: "r", usage: { A: { prompt_tokens: 2 } } },
      { id: "x", trace: "t2", parent: "r1", usage: { A: { prompt_tokens: 4 } } },
      { id: "y", trace: "t2", parent: "x", usage: { B: { prompt_tokens: 8 } }, ended: false },
    ],
    ids: ["r", "x"],
    limit: 4,
    expected: {
      r: {
        A: usage({ requests: 3, prompt_tokens: 7, total_tokens: 7 }),
      },
      x: { A: usage({ requests: 1, prompt_tokens: 4, total_tokens: 4 }) },
    },
    unfinished: ["y"],
  },
  {
    name: "a trace whose descendants in another trace overflow the limit does not fit",
    calls: [
      { id: "r", trace: "t1" },
      { id: "r1", trace: "t1", parent: "r" },
      { id: "x", trace: "t2", parent: "r1" },
      { id: "y", trace: "t2", parent: "x" },
    ],
    ids: ["r"],
    limit: 3,
    expected: { tooLarge: "t1", matched: 4 },
  },
  {
    name: "two traces of a root and a crossing child split into batches by bisection",
    calls: [
      { id: "r", trace: "t1", usage: { A: { prompt_tokens: 1 } } },
      { id: "x", trace: "t2", parent: "r", usage: { A: { prompt_tokens: 4 } } },
      { id: "s", trace: "t3", usage: { A: { prompt_tokens: 16 } } },
    ],
    ids: ["r", "s"],
    limit: 2,
    expected: {
      r: { A: usage({ requests: 2, prompt_tokens: 5, total_tokens: 5 }) },
      s: { A: usage({ requests: 1, prompt_tokens: 16, total_tokens: 16 }) },
    },
  },
  {
    name: "two parentless calls in one trace are two roots",
    calls: [
      { id: "p", trace: "t", usage: { A: { prompt_tokens: 1 } } },
      { id: "q", trace: "t", usage: { A: { prompt_tokens: 2 } } },
      { id: "q1", trace: "t", parent: "q", usage: { A: { prompt_tokens: 4 } } },
    ],
    ids: ["p", "q"],
    limit: 3,
    expected: {
      p: { A: usage({ requests: 1, prompt_tokens: 1, total_tokens: 1 }) },
      q: { A: usage({ requests: 2, prompt_tokens: 6, total_tokens: 6 }) },
    },
  },
  {
    name: "a cycle of parents belongs to no root, and its members count each other",
    calls: [
      { id: "r", trace: "t", usage: { A: { prompt_tokens: 1 } } },
      { id: "c1", trace: "t", parent: "c2", usage: { A: { prompt_tokens: 2 } } },
      { id: "c2", trace: "t", parent: "c1", usage: { A: { prompt_tokens: 4 } } },
    ],
    ids: ["r", "c1"],
    limit: 3,
    expected: {
      r: { A: usage({ requests: 1, prompt_tokens: 1, total_tokens: 1 }) },
      c1: { A: usage({ requests: 2, prompt_tokens: 6, total_tokens: 6 }) },
    },
  },
];

describeBackends("callUsage in batches", (ctx) => {
  describe.each(BATCH_CASES)("$name", (c) => {
    it("then the answer is whole, or LimitExceededError names the trace", async () => {
      const p = unique("ent/proj");
      await ctx.store.calls.upsertBatch(batch(p, c.calls));
      const asked = ctx.store.calls.callUsage(p, c.ids, { limit: c.limit });
      if ("tooLarge" in c.expected) {
        const err = await asked.catch((e: unknown) => e);
        expect(err).toBeInstanceOf(LimitExceededError);
        expect(err).toMatchObject({
          traceId: c.expected.tooLarge,
          matched: c.expected.matched,
          limit: c.limit,
        });
        expect((err as Error).message).toMatch(
          new RegExp(`"${c.expected.tooLarge}".*limit of ${c.limit}.*larger limit`),
        );
        return;
      }
      const result = await asked;
      expect(result.call_usage).toEqual(c.expected);
      expect(result.unfinished_call_ids).toEqual(c.unfinished ?? []);
    });
  });

  it("when a trace's calls arrive children first, then they link to its root as their parents arrive", async () => {
    const p = unique("ent/proj");
    const calls: SeedCall[] = [
      { id: "r", usage: { A: { prompt_tokens: 1 } } },
      { id: "m", parent: "r", usage: { A: { prompt_tokens: 2 } } },
      { id: "l1", parent: "m", usage: { A: { prompt_tokens: 4 } } },
      { id: "l2", parent: "m", usage: { B: { prompt_tokens: 8 } } },
    ];
    // Leaves first, then the middle, then the root: three batches, each a different order.
    for (const ids of [["l2", "l1"], ["m"], ["r"]]) {
      await ctx.store.calls.upsertBatch(
        batch(
          p,
          ids.map((id) => calls.find((c) => c.id === id)!),
        ),
      );
    }
    const links = await ctx.store.sql.query<{ id: string; link: number }>(
      "SELECT id, link FROM calls WHERE project_id = $1 ORDER BY id",
      [p],
    );
    expect(links.map((l) => [l.id, Number(l.link)])).toEqual([
      ["l1", 1],
      ["l2", 1],
      ["m", 1],
      ["r", 2],
    ]);
    const result = await ctx.store.calls.callUsage(p, ["r", "m"], { includeCosts: true });
    expect(result.call_usage.r?.A?.prompt_tokens).toBe(7);
    expect(result.call_usage.r?.B?.prompt_tokens).toBe(8);
    expect(result.call_usage.m?.A?.prompt_tokens).toBe(6);
  });

  it("when a call ends again, then its usage is the new end's", async () => {
    const p = unique("ent/proj");
    await ctx.store.calls.upsertBatch(batch(p, TREE));
    await ctx.store.calls.endCall({
      project_id: p,
      id: "grandchild",
      ended_at: T0,
      summary: { usage: { C: { prompt_tokens: 5 } } },
    });
    const result = await ctx.store.calls.callUsage(p, ["root"]);
    expect(result.call_usage.root?.C?.prompt_tokens).toBe(5);
    expect(result.call_usage.root?.A?.requests).toBe(2);
    const days = await ctx.store.calls.usageByDay(p, "2026-03-01", "2026-03-01");
    expect(days["2026-03-01"]?.C?.prompt_tokens).toBe(5);
  });

  it("when a project's calls were stored before usage rows existed, then migrating to version 5 sums them alike", async () => {
    const dir = join(ctx.dataDir, "v4");
    mkdirSync(dir, { recursive: true });
    const fresh =
      ctx.backend === "sqlite"
        ? new SqliteSql({ path: join(dir, "arbor.db") })
        : new PostgresSql({ connectionString: PG_URL, schema: `${ctx.schema}_v4` });
    if (ctx.backend === "postgres") await fresh.exec(`CREATE SCHEMA ${ctx.schema}_v4`);
    try {
      await migrate(fresh, MIGRATIONS.slice(0, 4));
      const rows: [string, string | null, string | null, string | null, string | null][] = [
        // id, parent, summary, usage_json (null: ended before version 4), deleted_at
        ["r", null, JSON.stringify({ usage: { A: { prompt_tokens: 1 }, Z: {} } }), "{}", null],
        ["c", "r", JSON.stringify({ usage: { A: { input_tokens: 2, requests: 3 } } }), null, null],
        ["d", "c", JSON.stringify({ usage: { B: { prompt_tokens: 4 } } }), null, null],
        ["gone", "r", JSON.stringify({ usage: { A: { prompt_tokens: 100 } } }), null, T0],
        ["odd", "r", JSON.stringify({ usage: "oops", other: [1] }), null, null],
      ];
      for (const [id, parent, summary, usageJson, deleted] of rows) {
        await fresh.exec(
          `INSERT INTO calls (project_id, id, trace_id, parent_id, op_name, started_at, ended_at,
             summary, usage_json, deleted_at, started, start_hash)
           VALUES ('e/p', $1, 't', $2, 'op', $3, $3, $4, $5, $6, 1, 'h')`,
          [id, parent, T0, summary, usageJson, deleted],
        );
      }
      expect(await migrate(fresh, MIGRATIONS.slice(0, 5))).toEqual([5]);
      await fresh.close();
      const store = await openStore(
        ctx.backend === "sqlite"
          ? { dataDir: dir }
          : { databaseUrl: PG_URL, schema: `${ctx.schema}_v4`, blobDir: join(dir, "blobs") },
      );
      try {
        const result = await store.calls.callUsage("e/p", ["r", "c"]);
        expect(result.call_usage).toEqual({
          r: {
            A: usage({ requests: 4, prompt_tokens: 3, total_tokens: 3 }),
            B: usage({ requests: 1, prompt_tokens: 4, total_tokens: 4 }),
          },
          c: {
            A: usage({ requests: 3, prompt_tokens: 2, total_tokens: 2 }),
            B: usage({ requests: 1, prompt_tokens: 4, total_tokens: 4 }),
          },
        });
        const links = await store.sql.query<{ id: string; link: number }>(
          "SELECT id, link FROM calls WHERE deleted_at IS NULL ORDER BY id",
        );
        expect(links.map((l) => [l.id, Number(l.link)])).toEqual([
          ["c", 1],
          ["d", 1],
          ["odd", 1],
          ["r", 2],
        ]);
      } finally {
        await store.close();
      }
    } finally {
      if (ctx.backend === "postgres")
        await ctx.store.sql.exec(`DROP SCHEMA IF EXISTS ${ctx.schema}_v4 CASCADE`);
    }
  });
});

/** A small deterministic PRNG, so a failing forest can be replayed from its seed. */
function prng(seed: number): () => number {
  let s = seed >>> 0;
  return () => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return s / 2 ** 32;
  };
}

describeBackends("callUsage against a walk of every parent link", (ctx) => {
  it.each([1, 2, 3, 4, 5, 6])(
    "when forest %i arrives in random order, with crossings, orphans, cycles and deletes, then every answer equals the walk",
    async (seed) => {
      const random = prng(seed);
      const pick = <T>(list: readonly T[]): T => list[Math.floor(random() * list.length)]!;
      const p = unique("ent/forest");
      const calls: SeedCall[] = [];
      for (let i = 0; i < 60; i++) {
        const trace = `t${Math.floor(random() * 4)}`;
        const sameTrace = calls.filter((c) => c.trace === trace);
        const roll = random();
        const parent =
          i === 0 || roll < 0.15
            ? undefined
            : roll < 0.2
              ? `ghost${i}`
              : roll < 0.27
                ? pick(calls).id // maybe another trace
                : roll < 0.3
                  ? `n${i + 1 + Math.floor(random() * 5)}` // a later call: cycles, children first
                  : sameTrace.length > 0
                    ? pick(sameTrace).id
                    : undefined;
        calls.push({
          id: `n${i}`,
          trace,
          parent,
          ended: random() > 0.1,
          usage:
            random() < 0.8
              ? { [pick(["A", "B", "C"])]: { prompt_tokens: 1 + Math.floor(random() * 9) } }
              : undefined,
        });
      }
      // Several batches, each in shuffled order.
      const items = batch(p, calls).sort(() => random() - 0.5);
      for (let i = 0; i < items.length; i += 17)
        await ctx.store.calls.upsertBatch(items.slice(i, i + 17));
      const deleted = [pick(calls).id, pick(calls).id];
      await ctx.store.calls.deleteCalls(p, deleted);

      // The walk: every visible call's children by parent link, whatever their trace.
      const visible = new Map<string, SeedCall>();
      for (const c of await ctx.store.calls.queryCalls(p, {}, 1000)) {
        visible.set(c.id, calls.find((s) => s.id === c.id)!);
      }
      const children = new Map<string, string[]>();
      for (const c of visible.values()) {
        if (!c.parent) continue;
        children.set(c.parent, [...(children.get(c.parent) ?? []), c.id]);
      }
      const walk = (id: string) => {
        const seen = new Set<string>([id]);
        const queue = [id];
        while (queue.length > 0)
          for (const child of children.get(queue.shift()!) ?? [])
            if (!seen.has(child)) {
              seen.add(child);
              queue.push(child);
            }
        return seen;
      };
      for (let round = 0; round < 4; round++) {
        const ids = Array.from({ length: 1 + Math.floor(random() * 6) }, () => pick(calls).id);
        const expected: Record<string, Record<string, ModelUsage>> = {};
        const unfinished = new Set<string>();
        for (const id of ids) {
          expected[id] = {};
          if (!visible.has(id)) continue;
          for (const member of walk(id)) {
            const c = visible.get(member)!;
            if (c.ended === false) {
              unfinished.add(member);
              continue;
            }
            for (const [model, u] of Object.entries(
              (c.usage ?? {}) as Record<string, { prompt_tokens: number }>,
            )) {
              expected[id]![model] ??= usage({});
              const sum = expected[id]![model]!;
              sum.requests += 1;
              sum.prompt_tokens += u.prompt_tokens;
              sum.total_tokens += u.prompt_tokens;
            }
          }
        }
        for (const limit of [1_000_000, 12]) {
          const answer = await ctx.store.calls
            .callUsage(p, ids, { limit })
            .catch((e: unknown) => e);
          if (answer instanceof LimitExceededError && limit < 1_000_000) continue;
          expect(answer).toEqual({
            call_usage: expected,
            unfinished_call_ids: [...unfinished].sort(),
          });
        }
      }
    },
  );
});
