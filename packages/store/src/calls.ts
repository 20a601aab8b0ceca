import { createHash } from "node:crypto";
import { type Clock, fromJson, type Json, strOrNull, toJson } from "./common.ts";
import { ConflictError, LimitExceededError } from "./errors.ts";
import { uuidv7 } from "./ids.ts";
import { isoDate } from "./prices.ts";
import { type Dialect, inList, listParam, type Row, type Sql, type SqlValue } from "./sql.ts";

export interface CallStartInput {
  project_id: string;
  /** Generated (UUID v7) when absent. */
  id?: string | null;
  /** Generated when absent: the call starts a new trace. */
  trace_id?: string | null;
  parent_id?: string | null;
  op_name: string;
  display_name?: string | null;
  started_at: string | Date;
  /** Free-form JSON, stored as sent (any value a JSON body parses to). */
  attributes?: unknown;
  inputs?: unknown;
}

export interface CallEndInput {
  project_id: string;
  id: string;
  ended_at: string | Date;
  /** Free-form JSON, stored as sent; `summary.usage` is what aggregation sums. */
  output?: unknown;
  exception?: string | null;
  summary?: unknown;
}

/** A batch item; the wire's `{mode, req: {start}}` / `{mode, req: {end}}` shape is accepted too. */
export type CallBatchItem =
  | { mode: "start"; start: CallStartInput }
  | { mode: "end"; end: CallEndInput }
  | { mode: "start"; req: { start: CallStartInput } }
  | { mode: "end"; req: { end: CallEndInput } };

function startOf(item: CallBatchItem): CallStartInput {
  return "req" in item
    ? (item.req as { start: CallStartInput }).start
    : (item as { start: CallStartInput }).start;
}

function endOf(item: CallBatchItem): CallEndInput {
  return "req" in item
    ? (item.req as { end: CallEndInput }).end
    : (item as { end: CallEndInput }).end;
}

export interface Call {
  project_id: string;
  id: string;
  trace_id: string;
  parent_id: string | null;
  op_name: string;
  display_name: string | null;
  /** ISO 8601 UTC, millisecond precision. */
  started_at: string;
  ended_at: string | null;
  inputs: Json;
  output: Json;
  exception: string | null;
  attributes: Json;
  summary: Json;
  deleted_at: string | null;
}

export interface CallFilter {
  trace_ids?: readonly string[];
  call_ids?: readonly string[];
  parent_ids?: readonly string[];
  op_names?: readonly string[];
  /** Inclusive lower bound on started_at. */
  started_after?: string | Date;
  /** Exclusive upper bound on started_at. */
  started_before?: string | Date;
  trace_roots_only?: boolean;
}

export interface ModelUsage {
  requests: number;
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  cache_read_input_tokens: number;
  cache_creation_input_tokens: number;
  prompt_tokens_total_cost: number | null;
  completion_tokens_total_cost: number | null;
  cache_read_input_tokens_total_cost: number | null;
  cache_creation_input_tokens_total_cost: number | null;
}

export interface CallUsageResult {
  /** One key per distinct requested id; missing, deleted or foreign ids map to {}. */
  call_usage: Record<string, Record<string, ModelUsage>>;
  /** Sorted ids of the calls read that have no ended_at. */
  unfinished_call_ids: string[];
}

interface PreparedStart {
  project_id: string;
  id: string;
  trace_id: string;
  trace_generated: boolean;
  parent_id: string | null;
  op_name: string;
  display_name: string | null;
  started_at: string;
  inputs: string | null;
  attributes: string | null;
  hash: string;
}

interface PreparedEnd {
  project_id: string;
  id: string;
  ended_at: string;
  output: string | null;
  exception: string | null;
  summary: string | null;
  /** `summary.usage` as aggregation reads it (see `usageOf`). */
  usage: string;
}

/** JSON with sorted keys: equal content gives an equal hash whatever the key order. */
function canonical(value: unknown): string {
  if (value === null || typeof value !== "object") return JSON.stringify(value ?? null);
  if (Array.isArray(value)) return `[${value.map(canonical).join(",")}]`;
  const obj = value as Record<string, unknown>;
  const keys = Object.keys(obj)
    .filter((k) => obj[k] !== undefined)
    .sort();
  return `{${keys.map((k) => `${JSON.stringify(k)}:${canonical(obj[k])}`).join(",")}}`;
}

/**
 * Free text a call reports (its display name, its exception): kept as sent, but for NUL, which
 * PostgreSQL cannot store in text; it becomes U+FFFD on every backend alike.
 */
function freeText(value: string | null | undefined): string | null {
  return value === undefined || value === null
    ? null
    : value.replaceAll("\u0000", "\ufffd").toWellFormed();
}

function prepareStart(s: CallStartInput, now: number): PreparedStart {
  const id = s.id ?? uuidv7(now);
  // The hash covers what the client sent: a retried start without trace_id must not conflict
  // with itself just because a new trace id was generated for it.
  const start = {
    trace_id: s.trace_id ?? null,
    parent_id: s.parent_id ?? null,
    op_name: s.op_name,
    display_name: freeText(s.display_name),
    started_at: isoDate(s.started_at),
    inputs: s.inputs ?? null,
    attributes: s.attributes ?? null,
  };
  return {
    project_id: s.project_id,
    id,
    ...start,
    trace_id: s.trace_id ?? uuidv7(now),
    trace_generated: !s.trace_id,
    inputs: toJson(start.inputs),
    attributes: toJson(start.attributes),
    hash: createHash("sha256").update(canonical(start)).digest("base64url"),
  };
}

function prepareEnd(e: CallEndInput): PreparedEnd {
  return {
    project_id: e.project_id,
    id: e.id,
    ended_at: isoDate(e.ended_at),
    output: toJson(e.output ?? null),
    exception: freeText(e.exception),
    summary: toJson(e.summary ?? null),
    usage: usageOf(e.summary),
  };
}

/** The fields of a model's usage that aggregation sums. */
const USAGE_FIELDS = [
  "requests",
  "prompt_tokens",
  "input_tokens",
  "completion_tokens",
  "output_tokens",
  "total_tokens",
  "cache_read_input_tokens",
  "cache_creation_input_tokens",
] as const;

/**
 * `summary.usage` as aggregation reads it, extracted when the call ends: model → its finite
 * numeric fields (`{}` without a usage map). Whatever else a summary holds (free-form, kept as
 * sent) never reaches the aggregation query, so no content of it can make that query fail.
 */
function usageOf(summary: unknown): string {
  const usage = (summary as { usage?: unknown } | null | undefined)?.usage;
  if (!isPlainObject(summary) || !isPlainObject(usage)) return "{}";
  const out: Record<string, Record<string, number>> = {};
  for (const [model, value] of Object.entries(usage)) {
    if (!isPlainObject(value)) continue;
    const fields: Record<string, number> = {};
    for (const field of USAGE_FIELDS) {
      const n = value[field];
      if (typeof n === "number" && Number.isFinite(n)) fields[field] = n;
    }
    out[freeText(model)!] = fields;
  }
  return JSON.stringify(out);
}

function isPlainObject(value: unknown): value is Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

function toCall(r: Row): Call {
  return {
    project_id: String(r.project_id),
    id: String(r.id),
    trace_id: String(r.trace_id),
    parent_id: strOrNull(r.parent_id),
    op_name: String(r.op_name),
    display_name: strOrNull(r.display_name),
    started_at: String(r.started_at),
    ended_at: strOrNull(r.ended_at),
    inputs: fromJson(r.inputs),
    output: fromJson(r.output),
    exception: strOrNull(r.exception),
    attributes: fromJson(r.attributes),
    summary: fromJson(r.summary),
    deleted_at: strOrNull(r.deleted_at),
  };
}

const UPSERT_COLUMNS = [
  "project_id",
  "id",
  "trace_id",
  "parent_id",
  "op_name",
  "display_name",
  "started_at",
  "ended_at",
  "inputs",
  "output",
  "exception",
  "attributes",
  "summary",
  "usage_json",
  "started",
  "start_hash",
] as const;
const START_FIELDS = [
  "trace_id",
  "parent_id",
  "op_name",
  "display_name",
  "started_at",
  "inputs",
  "attributes",
  "start_hash",
];
const END_FIELDS = ["ended_at", "output", "exception", "summary", "usage_json"];
const UPSERT_CONFLICT = `ON CONFLICT (project_id, id) DO UPDATE SET ${[
  // Start fields are written once: a repeated (identical) start keeps the stored ones.
  ...START_FIELDS.map(
    (f) =>
      `${f} = CASE WHEN excluded.started = 1 AND calls.started = 0 THEN excluded.${f} ELSE calls.${f} END`,
  ),
  ...END_FIELDS.map(
    (f) => `${f} = CASE WHEN excluded.ended_at IS NOT NULL THEN excluded.${f} ELSE calls.${f} END`,
  ),
  "started = CASE WHEN excluded.started = 1 THEN 1 ELSE calls.started END",
].join(", ")}`;
const ROWS_PER_STATEMENT = 400;

function upsertText(rows: number): string {
  const width = UPSERT_COLUMNS.length;
  const values = Array.from(
    { length: rows },
    (_, r) => `(${Array.from({ length: width }, (_, c) => `$${r * width + c + 1}`).join(", ")})`,
  ).join(", ");
  return `INSERT INTO calls (${UPSERT_COLUMNS.join(", ")}) VALUES ${values} ${UPSERT_CONFLICT}`;
}

interface Merged {
  project_id: string;
  id: string;
  start?: PreparedStart;
  end?: PreparedEnd;
}

/** The usage numbers of one `summary.usage[model]` object, per dialect; non-numbers read as 0. */
function usageSql(dialect: Dialect) {
  const n = (k: string) =>
    dialect === "sqlite"
      ? `(CASE WHEN json_type(u, '$.${k}') IN ('integer', 'real') THEN json_extract(u, '$.${k}') ELSE 0 END)`
      : `(CASE WHEN jsonb_typeof(u -> '${k}') = 'number' THEN (u ->> '${k}')::float8 ELSE 0 END)`;
  const has = (k: string) =>
    dialect === "sqlite"
      ? `json_type(u, '$.${k}') IN ('integer', 'real')`
      : `jsonb_typeof(u -> '${k}') = 'number'`;
  // `usage_json` holds only model → numbers (`usageOf`); rows ended before it existed fall back
  // to their summary.
  const usageRows =
    dialect === "sqlite"
      ? `SELECT t.root_id, c.started_at, j.key AS model, j.value AS u
         FROM tree t CROSS JOIN calls c
         CROSS JOIN json_each(CASE WHEN c.usage_json IS NOT NULL THEN c.usage_json
                              WHEN json_type(c.summary, '$.usage') = 'object'
                              THEN json_extract(c.summary, '$.usage') ELSE '{}' END) j
         WHERE c.project_id = $1 AND c.id = t.id AND j.type = 'object'`
      : `SELECT t.root_id, c.started_at, j.key AS model, j.value AS u
         FROM tree t JOIN calls c ON c.project_id = $1 AND c.id = t.id
         CROSS JOIN LATERAL (SELECT CASE WHEN c.usage_json IS NOT NULL THEN c.usage_json::jsonb
                                         ELSE c.summary::jsonb -> 'usage' END AS usage) s
         CROSS JOIN LATERAL jsonb_each(CASE WHEN jsonb_typeof(s.usage) = 'object'
                                       THEN s.usage ELSE '{}'::jsonb END) j
         WHERE (c.usage_json IS NOT NULL OR c.summary IS NOT NULL)
           AND jsonb_typeof(j.value) = 'object'`;
  return { n, has, usageRows };
}

/** Code-point order (a database collation may order otherwise). */
function compare(a: string, b: string): number {
  return a < b ? -1 : a > b ? 1 : 0;
}

/**
 * Sums the usage of the calls in `tree` (a CTE of `(root_id, id)` pairs, parameters `$1` the
 * project and what the CTE uses) per `root_id` and model, in the database; with costs, each call
 * is priced at the price in effect when it started.
 */
async function sumUsage(
  sql: Sql,
  tree: string,
  params: SqlValue[],
  includeCosts: boolean,
): Promise<{ key: string; model: string; usage: ModelUsage }[]> {
  const { n, has, usageRows } = usageSql(sql.dialect);
  const priceId = includeCosts
    ? `, (SELECT p.id FROM prices p
          WHERE p.model = usage_rows.model AND (p.project_id = $1 OR p.project_id IS NULL)
            AND p.effective_date <= usage_rows.started_at
          ORDER BY CASE WHEN p.project_id IS NULL THEN 1 ELSE 0 END, p.effective_date DESC
          LIMIT 1) AS price_id`
    : "";
  const costs = includeCosts
    ? `, SUM(per_call.prompt * COALESCE(p.prompt_token_cost, 0)) AS prompt_cost,
         SUM(per_call.completion * COALESCE(p.completion_token_cost, 0)) AS completion_cost,
         SUM(per_call.cache_read * COALESCE(p.cache_read_input_token_cost, 0)) AS cache_read_cost,
         SUM(per_call.cache_creation * COALESCE(p.cache_creation_input_token_cost, 0)) AS cache_creation_cost`
    : "";
  const rows = await sql.query(
    `${tree},
     usage_rows AS (${usageRows}),
     per_call AS (
       SELECT root_id, model,
         CASE WHEN ${has("requests")} THEN ${n("requests")} ELSE 1 END AS requests,
         ${n("prompt_tokens")} + ${n("input_tokens")} AS prompt,
         ${n("completion_tokens")} + ${n("output_tokens")} AS completion,
         ${n("total_tokens")} AS total_raw,
         ${n("cache_read_input_tokens")} AS cache_read,
         ${n("cache_creation_input_tokens")} AS cache_creation
         ${priceId}
       FROM usage_rows
     )
     SELECT per_call.root_id, per_call.model,
       SUM(per_call.requests) AS requests,
       SUM(per_call.prompt) AS prompt_tokens,
       SUM(per_call.completion) AS completion_tokens,
       SUM(CASE WHEN per_call.total_raw > 0 THEN per_call.total_raw
                ELSE per_call.prompt + per_call.completion END) AS total_tokens,
       SUM(per_call.cache_read) AS cache_read_input_tokens,
       SUM(per_call.cache_creation) AS cache_creation_input_tokens
       ${costs}
     FROM per_call ${includeCosts ? "LEFT JOIN prices p ON p.id = per_call.price_id" : ""}
     GROUP BY per_call.root_id, per_call.model`,
    params,
  );
  return rows.map((r) => ({
    key: String(r.root_id),
    model: String(r.model),
    usage: {
      requests: Number(r.requests),
      prompt_tokens: Number(r.prompt_tokens),
      completion_tokens: Number(r.completion_tokens),
      total_tokens: Number(r.total_tokens),
      cache_read_input_tokens: Number(r.cache_read_input_tokens),
      cache_creation_input_tokens: Number(r.cache_creation_input_tokens),
      prompt_tokens_total_cost: includeCosts ? Number(r.prompt_cost) : null,
      completion_tokens_total_cost: includeCosts ? Number(r.completion_cost) : null,
      cache_read_input_tokens_total_cost: includeCosts ? Number(r.cache_read_cost) : null,
      cache_creation_input_tokens_total_cost: includeCosts ? Number(r.cache_creation_cost) : null,
    },
  }));
}

export class CallsRepo {
  readonly #sql: Sql;
  readonly #now: Clock;
  constructor(sql: Sql, now: Clock) {
    this.#sql = sql;
    this.#now = now;
  }

  /**
   * Records a call's start. Repeating a start with identical content is harmless; with different
   * content → ConflictError. An end that arrived first is merged in.
   */
  async startCall(start: CallStartInput): Promise<{ id: string; trace_id: string }> {
    const [result] = await this.upsertBatch([{ mode: "start", start }]);
    return result!;
  }

  /** Records a call's end; before its start it is stored but stays invisible. */
  async endCall(end: CallEndInput): Promise<void> {
    await this.upsertBatch([{ mode: "end", end }]);
  }

  /**
   * Applies starts and ends in order, in ONE transaction: all or nothing. A conflicting start
   * anywhere rejects the whole batch with ConflictError.
   */
  async upsertBatch(items: readonly CallBatchItem[]): Promise<{ id: string; trace_id: string }[]> {
    const now = this.#now();
    const merged = new Map<string, Merged>();
    const started: { project_id: string; id: string; trace_id: string; generated: boolean }[] = [];
    for (const item of items) {
      const prepared =
        item.mode === "start" ? prepareStart(startOf(item), now) : prepareEnd(endOf(item));
      const key = `${prepared.project_id}\u0000${prepared.id}`;
      let m = merged.get(key);
      if (!m) {
        m = { project_id: prepared.project_id, id: prepared.id };
        merged.set(key, m);
      }
      if (item.mode === "start") {
        const s = prepared as PreparedStart;
        if (m.start && m.start.hash !== s.hash) {
          throw new ConflictError(`Call ${s.id} was started twice with different content`);
        }
        m.start ??= s;
        started.push({
          project_id: s.project_id,
          id: s.id,
          trace_id: m.start.trace_id,
          generated: s.trace_generated,
        });
      } else {
        m.end = prepared as PreparedEnd;
      }
    }
    // Key order: two concurrent batches touching the same calls lock them in the same order,
    // so PostgreSQL never deadlocks them against each other.
    const rows = [...merged.values()].sort((a, b) =>
      a.project_id === b.project_id
        ? a.id < b.id
          ? -1
          : a.id > b.id
            ? 1
            : 0
        : a.project_id < b.project_id
          ? -1
          : 1,
    );
    if (rows.length > 0) await this.#sql.transaction((tx) => this.#write(tx, rows));
    // A repeated start without trace_id keeps the trace stored the first time: report that one.
    const generated = started.filter((s) => s.generated);
    const byProject = new Map<string, { id: string }[]>();
    for (const g of generated) {
      const list = byProject.get(g.project_id) ?? [];
      list.push(g);
      byProject.set(g.project_id, list);
    }
    const stored = new Map<string, string>();
    for (const [project, list] of byProject) {
      const traces = await this.#storedTraces(project, list);
      list.forEach((g, i) => {
        if (traces[i]) stored.set(`${project}\u0000${g.id}`, traces[i]);
      });
    }
    return started.map((s) => ({
      id: s.id,
      trace_id: stored.get(`${s.project_id}\u0000${s.id}`) ?? s.trace_id,
    }));
  }

  /** The stored trace ids of these calls (undefined where none), in the same order. */
  async #storedTraces(
    projectId: string,
    calls: readonly { id: string }[],
  ): Promise<(string | undefined)[]> {
    if (calls.length === 0) return [];
    const found = new Map<string, string>();
    for (let i = 0; i < calls.length; i += 5000) {
      const chunk = calls.slice(i, i + 5000).map((c) => c.id);
      const rows = await this.#sql.query<{ id: string; trace_id: string }>(
        `SELECT id, trace_id FROM calls WHERE project_id = $1 AND ${inList(this.#sql.dialect, "id", 2)}`,
        [projectId, listParam(chunk)],
      );
      for (const r of rows) found.set(String(r.id), String(r.trace_id));
    }
    return calls.map((c) => found.get(c.id));
  }

  async #write(tx: Sql, rows: Merged[]): Promise<void> {
    // Conflict check against stored starts, per project, one query per chunk of ids.
    const startsByProject = new Map<string, Map<string, string>>();
    for (const r of rows) {
      if (!r.start) continue;
      let ids = startsByProject.get(r.project_id);
      if (!ids) {
        ids = new Map();
        startsByProject.set(r.project_id, ids);
      }
      ids.set(r.id, r.start.hash);
    }
    for (const [project, ids] of startsByProject) {
      const all = [...ids.keys()];
      for (let i = 0; i < all.length; i += 5000) {
        const chunk = all.slice(i, i + 5000);
        const existing = await tx.query<{ id: string; start_hash: string }>(
          `SELECT id, start_hash FROM calls WHERE project_id = $1 AND started = 1
             AND ${inList(tx.dialect, "id", 2)}`,
          [project, listParam(chunk)],
        );
        for (const e of existing) {
          if (ids.get(String(e.id)) !== String(e.start_hash)) {
            throw new ConflictError(`Call ${e.id} already exists with different content`);
          }
        }
      }
    }
    for (let i = 0; i < rows.length; i += ROWS_PER_STATEMENT) {
      const chunk = rows.slice(i, i + ROWS_PER_STATEMENT);
      const params: SqlValue[] = [];
      for (const r of chunk) {
        const s = r.start;
        const e = r.end;
        params.push(
          r.project_id,
          r.id,
          s?.trace_id ?? null,
          s?.parent_id ?? null,
          s?.op_name ?? null,
          s?.display_name ?? null,
          s?.started_at ?? null,
          e?.ended_at ?? null,
          s?.inputs ?? null,
          e?.output ?? null,
          e?.exception ?? null,
          s?.attributes ?? null,
          e?.summary ?? null,
          e?.usage ?? null,
          s ? 1 : 0,
          s?.hash ?? null,
        );
      }
      await tx.exec(upsertText(chunk.length), params);
    }
  }

  /** A visible (started, not deleted) call of this project. */
  async getCall(projectId: string, id: string): Promise<Call | undefined> {
    const row = await this.#sql.one(
      "SELECT * FROM calls WHERE project_id = $1 AND id = $2 AND started = 1 AND deleted_at IS NULL",
      [projectId, id],
    );
    return row ? toCall(row) : undefined;
  }

  /** Visible calls of the project matching every given filter, by started_at then id. */
  async queryCalls(
    projectId: string,
    filter: CallFilter = {},
    limit = 100,
    offset = 0,
  ): Promise<Call[]> {
    const d = this.#sql.dialect;
    const where = ["project_id = $1", "started = 1", "deleted_at IS NULL"];
    const params: SqlValue[] = [projectId];
    const list = (column: string, values: readonly string[] | undefined) => {
      if (values === undefined) return;
      params.push(listParam(values));
      where.push(inList(d, column, params.length));
    };
    list("trace_id", filter.trace_ids);
    list("id", filter.call_ids);
    list("parent_id", filter.parent_ids);
    list("op_name", filter.op_names);
    if (filter.started_after !== undefined) {
      params.push(isoDate(filter.started_after));
      where.push(`started_at >= $${params.length}`);
    }
    if (filter.started_before !== undefined) {
      params.push(isoDate(filter.started_before));
      where.push(`started_at < $${params.length}`);
    }
    if (filter.trace_roots_only) where.push("parent_id IS NULL");
    params.push(Math.max(0, Math.floor(limit)), Math.max(0, Math.floor(offset)));
    const rows = await this.#sql.query(
      `SELECT * FROM calls WHERE ${where.join(" AND ")}
       ORDER BY started_at, id LIMIT $${params.length - 1} OFFSET $${params.length}`,
      params,
    );
    return rows.map(toCall);
  }

  /** Marks the calls and all their descendants deleted; returns how many were newly marked. */
  async deleteCalls(projectId: string, ids: readonly string[]): Promise<number> {
    if (ids.length === 0) return 0;
    const d = this.#sql.dialect;
    return this.#sql.transaction((tx) =>
      tx.exec(
        `WITH RECURSIVE tree(id) AS (
           SELECT id FROM calls
           WHERE project_id = $1 AND ${inList(d, "id", 2)} AND started = 1 AND deleted_at IS NULL
           UNION
           SELECT c.id FROM tree t CROSS JOIN calls c
           WHERE c.project_id = $1 AND c.parent_id = t.id AND c.started = 1 AND c.deleted_at IS NULL
         )
         UPDATE calls SET deleted_at = $3
         WHERE project_id = $1 AND id IN (SELECT id FROM tree) AND deleted_at IS NULL`,
        [projectId, listParam(ids), new Date(this.#now()).toISOString()],
      ),
    );
  }

  /**
   * Usage per requested call (its own plus every descendant's), per model, computed in the
   * database. Throws LimitExceededError before aggregating when the trees hold more than `limit`
   * calls.
   */
  async callUsage(
    projectId: string,
    callIds: readonly string[],
    options: { includeCosts?: boolean; limit?: number } = {},
  ): Promise<CallUsageResult> {
    if (this.#sql.dialect === "sqlite")
      return this.#callUsage(this.#sql, projectId, callIds, options);
    // One REPEATABLE READ snapshot for the count, the sums and the unfinished ids. The planner
    // sorts the usage rows for the aggregate (a recursive CTE's estimates are tiny); more
    // work_mem keeps 100k rows off the disk.
    return this.#sql.transaction(async (tx) => {
      await tx.exec("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY");
      await tx.exec("SET LOCAL work_mem = '64MB'");
      return this.#callUsage(tx, projectId, callIds, options);
    });
  }

  /**
   * A project's usage per UTC day (of each call's `started_at`) and model, over the days
   * `[startDate, endDate]` (`YYYY-MM-DD`): every visible call counted once for its own usage.
   * Summed in the database; the answer has one entry per day and model.
   */
  async usageByDay(
    projectId: string,
    startDate: string,
    endDate: string,
    options: { includeCosts?: boolean } = {},
  ): Promise<Record<string, Record<string, ModelUsage>>> {
    // Stored timestamps are ISO 8601 in UTC (`isoDate`), so a day's calls sort between its
    // midnight and the next day's.
    const next = new Date(`${endDate}T00:00:00.000Z`);
    next.setUTCDate(next.getUTCDate() + 1);
    const tree = `WITH tree(root_id, id) AS (
        SELECT substr(c.started_at, 1, 10), c.id FROM calls c
        WHERE c.project_id = $1 AND c.started = 1 AND c.deleted_at IS NULL
          AND c.started_at >= $2 AND c.started_at < $3
      )`;
    const params = [projectId, `${startDate}T00:00:00.000Z`, next.toISOString()];
    const rows = await sumUsage(this.#sql, tree, params, options.includeCosts ?? false);
    rows.sort((a, b) => compare(a.key, b.key) || compare(a.model, b.model));
    const days: Record<string, Record<string, ModelUsage>> = Object.create(null);
    for (const r of rows) {
      days[r.key] ??= Object.create(null);
      days[r.key]![r.model] = r.usage;
    }
    return days;
  }

  async #callUsage(
    sql: Sql,
    projectId: string,
    callIds: readonly string[],
    options: { includeCosts?: boolean; limit?: number },
  ): Promise<CallUsageResult> {
    const distinct = [...new Set(callIds)];
    // No prototype: a call id such as `__proto__` is a key like any other.
    const result: CallUsageResult = { call_usage: Object.create(null), unfinished_call_ids: [] };
    for (const id of distinct) result.call_usage[id] = {};
    if (distinct.length === 0) return result;
    const d = sql.dialect;
    const limit = options.limit ?? 10000;
    const includeCosts = options.includeCosts ?? false;
    // CROSS JOIN pins the join order on SQLite (tree outside, the parent index inside); without
    // it the planner walked the whole project per step.
    // `open` = 1 for a call without ended_at, so counting also tells whether the unfinished-ids
    // query is needed at all.
    const tree = `WITH RECURSIVE tree(root_id, id, open) AS (
        SELECT c.id, c.id, CASE WHEN c.ended_at IS NULL THEN 1 ELSE 0 END FROM calls c
        WHERE c.project_id = $1 AND ${inList(d, "c.id", 2)} AND c.started = 1 AND c.deleted_at IS NULL
        UNION
        SELECT t.root_id, c.id, CASE WHEN c.ended_at IS NULL THEN 1 ELSE 0 END
        FROM tree t CROSS JOIN calls c
        WHERE c.project_id = $1 AND c.parent_id = t.id AND c.started = 1 AND c.deleted_at IS NULL
      )`;
    const params = [projectId, listParam(distinct)];

    const count = await sql.one<{ n: number; open: number | null }>(
      `${tree} SELECT COUNT(*) AS n, SUM(open) AS open FROM tree`,
      params,
    );
    const matched = Number(count?.n ?? 0);
    if (matched > limit) throw new LimitExceededError(matched, limit);
    if (matched === 0) return result;

    for (const r of await sumUsage(sql, tree, params, includeCosts)) {
      const usage = result.call_usage[r.key];
      if (usage) usage[r.model] = r.usage;
    }
    if (!Number(count?.open ?? 0)) return result;
    const unfinished = await sql.query<{ id: string }>(
      `${tree} SELECT DISTINCT id FROM tree WHERE open = 1`,
      params,
    );
    // Sorted here, not in SQL: a database collation may not order like code points.
    result.unfinished_call_ids = unfinished.map((u) => String(u.id)).sort();
    return result;
  }
}
