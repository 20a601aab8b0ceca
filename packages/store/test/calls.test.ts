import { describe, expect, it } from "vitest";
import {
  type CallBatchItem,
  ConflictError,
  type Json,
  LimitExceededError,
  type ModelUsage,
} from "../src/index.ts";
import { describeBackends, unique } from "./helpers.ts";

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
    expected: {
      r: {
        A: usage({ requests: 1, completion_tokens: 5, total_tokens: 5 }),
        C: usage({ requests: 1 }),
      },
    },
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
    await expect(
      ctx.store.calls.upsertBatch([{ mode: "start", start: start(p, "s", { inputs: {} }) }]),
    ).rejects.toBeInstanceOf(ConflictError);
    expect((await ctx.store.calls.getCall(p, "s"))?.op_name).toBe("op");
  });

  it("when a start without trace_id is retried, then it is idempotent and keeps the first trace", async () => {
    const p = unique("ent/proj");
    const input = { project_id: p, id: "no-trace", op_name: "op", started_at: T0 };
    const first = await ctx.store.calls.startCall(input);
    const again = await ctx.store.calls.startCall(input);
    expect(again).toEqual(first);
    const [batched] = await ctx.store.calls.upsertBatch([{ mode: "start", req: { start: input } }]);
    expect(batched).toEqual(first);
    const twice = await ctx.store.calls.upsertBatch([
      { mode: "start", start: { ...input, id: "fresh" } },
      { mode: "start", start: { ...input, id: "fresh" } },
    ]);
    expect(twice[0]?.trace_id).toBe(twice[1]?.trace_id);
    expect((await ctx.store.calls.getCall(p, "fresh"))?.trace_id).toBe(twice[0]?.trace_id);
    expect((await ctx.store.calls.getCall(p, "no-trace"))?.trace_id).toBe(first.trace_id);
  });

  it("when a batch holds thousands of items, then all land in one transaction; a conflict rolls back all", async () => {
    const p = unique("ent/proj");
    const calls: SeedCall[] = Array.from({ length: 3000 }, (_, i) => ({
      id: `b${i}`,
      parent: i === 0 ? undefined : `b${Math.floor((i - 1) / 4)}`,
      usage: { A: { prompt_tokens: 1, completion_tokens: 1 } },
    }));
    const started = await ctx.store.calls.upsertBatch(batch(p, calls));
    expect(started).toHaveLength(3000);
    const result = await ctx.store.calls.callUsage(p, ["b0"]);
    expect(result.call_usage.b0?.A).toEqual(
      usage({ requests: 3000, prompt_tokens: 3000, completion_tokens: 3000, total_tokens: 6000 }),
    );

    const bad = batch(p, [{ id: "new1" }, { id: "new2" }]);
    bad.push({
      mode: "start",
      start: { project_id: p, id: "b5", trace_id: "other", op_name: "x", started_at: T0 },
    });
    await expect(ctx.store.calls.upsertBatch(bad)).rejects.toBeInstanceOf(ConflictError);
    expect(await ctx.store.calls.getCall(p, "new1")).toBeUndefined();

    const twice = [
      { mode: "start" as const, start: start(p, "dup") },
      { mode: "start" as const, start: start(p, "dup", { op_name: "changed" }) },
    ];
    await expect(ctx.store.calls.upsertBatch(twice)).rejects.toBeInstanceOf(ConflictError);
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
