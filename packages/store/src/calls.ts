import { createHash } from "node:crypto";
import { type Clock, canonical, type Json, toJson } from "./common.ts";
import { ConflictError, InvalidInputError, LimitExceededError } from "./errors.ts";
import { uuidv7 } from "./ids.ts";
import { isoDate } from "./prices.ts";
import { bool, json, num, numOrNull, type RowOf, rowSchema, str, strOrNull } from "./rows.ts";
import { type Dialect, inList, listParam, type Sql, type SqlValue } from "./sql.ts";
import {
  storableText,
  USAGE_COLUMNS,
  type UsageRow,
  usageRowsJson,
  usageRowsOf,
} from "./usage-rows.ts";

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

/** A call as reads answer it: the `calls` table less what the store keeps for itself. */
const CALLS = rowSchema({
  project_id: str,
  id: str,
  trace_id: str,
  parent_id: strOrNull,
  op_name: str,
  display_name: strOrNull,
  /** ISO 8601 UTC, millisecond precision. */
  started_at: str,
  ended_at: strOrNull,
  inputs: json<Json>,
  output: json<Json>,
  exception: strOrNull,
  attributes: json<Json>,
  summary: json<Json>,
  deleted_at: strOrNull,
});
export interface Call extends RowOf<typeof CALLS> {}
/** Of a visible call: its id, its trace, its parent's id. */
const CALL_ID = CALLS.pick("id");
const CALL_TRACE = CALLS.pick("trace_id");
const CALL_PARENT = CALLS.pick("id", "parent_id", "trace_id");

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

/** A model's usage summed over calls: the counts of `UsageRow`, and their costs when asked. */
export interface ModelUsage extends Omit<UsageRow, "model"> {
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

/** What became of one batch item: stored (a start answers its call's ids), or refused. */
export type CallBatchResult =
  | { ok: true; id: string; trace_id: string }
  | { ok: true }
  | { ok: false; error: ConflictError | InvalidInputError };

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
  /** The call's own usage as aggregation counts it (`usageRowsOf`), or null. */
  usage_rows: string | null;
}

/**
 * Free text a call reports (its display name, its exception): kept as sent, but for NUL, which
 * PostgreSQL cannot store in text; it becomes U+FFFD on every backend alike.
 */
function freeText(value: string | null | undefined): string | null {
  return value === undefined || value === null ? null : storableText(value);
}

/** A key of a call (its ids, project, op name): a string with neither NUL nor a lone surrogate,
 * which no store could keep alike; else the item is refused, naming the field. */
function key(value: unknown, param: string): string {
  if (typeof value !== "string") {
    throw new InvalidInputError(`${param} must be a string`, { param, code: "invalid_value" });
  }
  if (value.includes("\u0000") || !value.isWellFormed()) {
    throw new InvalidInputError(`${param} contains a NUL character or a lone UTF-16 surrogate`, {
      param,
      code: "invalid_value",
    });
  }
  return value;
}

function optionalKey(value: unknown, param: string): string | null {
  return value === undefined || value === null ? null : key(value, param);
}

function timestamp(value: unknown, param: string): string {
  try {
    if (typeof value === "string" || value instanceof Date) return isoDate(value);
  } catch {
    // Reported below.
  }
  throw new InvalidInputError(`${param} is not a date-time`, { param, code: "invalid_value" });
}

function prepareStart(s: CallStartInput, now: number): PreparedStart {
  const projectId = key(s.project_id, "start.project_id");
  const id = optionalKey(s.id, "start.id") ?? uuidv7(now);
  // The hash covers what the client sent: a retried start without trace_id must not conflict
  // with itself just because a new trace id was generated for it.
  const start = {
    trace_id: optionalKey(s.trace_id, "start.trace_id"),
    parent_id: optionalKey(s.parent_id, "start.parent_id"),
    op_name: key(s.op_name, "start.op_name"),
    display_name: freeText(s.display_name),
    started_at: timestamp(s.started_at, "start.started_at"),
    inputs: s.inputs ?? null,
    attributes: s.attributes ?? null,
  };
  return {
    project_id: projectId,
    id,
    ...start,
    trace_id: start.trace_id ?? uuidv7(now),
    trace_generated: !start.trace_id,
    inputs: toJson(start.inputs),
    attributes: toJson(start.attributes),
    hash: createHash("sha256").update(canonical(start)).digest("base64url"),
  };
}

function prepareEnd(e: CallEndInput): PreparedEnd {
  return {
    project_id: key(e.project_id, "end.project_id"),
    id: key(e.id, "end.id"),
    ended_at: timestamp(e.ended_at, "end.ended_at"),
    output: toJson(e.output ?? null),
    exception: freeText(e.exception),
    summary: toJson(e.summary ?? null),
    usage_rows: usageRowsJson(usageRowsOf(e.summary)),
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
  "usage_rows",
  "link",
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
  "link",
  "start_hash",
];
const END_FIELDS = ["ended_at", "output", "exception", "summary", "usage_rows"];
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
/** Calls written per round of lookups (their ids and their parents' go in one list). */
const ROWS_PER_CHUNK = 5000;

function upsertText(rows: number): string {
  const width = UPSERT_COLUMNS.length;
  const values = Array.from(
    { length: rows },
    (_, r) => `(${Array.from({ length: width }, (_, c) => `$${r * width + c + 1}`).join(", ")})`,
  ).join(", ");
  return `INSERT INTO calls (${UPSERT_COLUMNS.join(", ")}) VALUES ${values} ${UPSERT_CONFLICT}
    RETURNING ${WRITTEN.columns()}`;
}

/** One call's items of a batch, merged. */
interface Merged {
  project_id: string;
  id: string;
  start?: PreparedStart;
  /** The items that started it, for their results. */
  startItems: number[];
  end?: PreparedEnd;
  /** Set while writing: 2, 1 or 0 (see migration 5) for a start stored now. */
  link?: number;
}

/** What the store holds of a call (or of a parent) before a batch is written. */
const STORED = rowSchema({
  id: str,
  trace_id: strOrNull,
  started: bool,
  ended_at: strOrNull,
  deleted_at: strOrNull,
  start_hash: strOrNull,
  link: num,
});
type Stored = RowOf<typeof STORED>;

/** A call as its upsert returns it, in the writing transaction's view. */
const WRITTEN = rowSchema({
  id: str,
  trace_id: strOrNull,
  started: bool,
  started_at: strOrNull,
  ended_at: strOrNull,
  deleted_at: strOrNull,
  /** `usageRowsJson`'s rows: `[model, requests, prompt, completion, total, cache read,
   * cache creation]`. */
  usage_rows: json<[string, ...number[]][]>,
});

/** A requested call: its trace, and how it links to the trace's root (see migration 5). */
const REQUESTED = rowSchema({ id: str, trace_id: str, link: num });

/** A trace's visible calls counted: all, unlinked, roots (link 2), without an end. */
const TRACE_SHAPE = rowSchema({ trace_id: str, n: num, unlinked: num, roots: num, open: num });

/** A walk's calls outside the batch's traces, and its calls without an end (null: none read). */
const WALK_COUNT = rowSchema({ outside: num, open: numOrNull });

/** Usage summed per key and model (`sumUsage`), and its costs when asked. */
const SUMS = rowSchema({
  key: str,
  model: str,
  requests: num,
  prompt_tokens: num,
  completion_tokens: num,
  total_tokens: num,
  cache_read_input_tokens: num,
  cache_creation_input_tokens: num,
});
const COSTS = rowSchema({
  prompt_cost: num,
  completion_cost: num,
  cache_read_cost: num,
  cache_creation_cost: num,
});

/** Code-point order (a database collation may order otherwise). */
function compare(a: string, b: string): number {
  return a < b ? -1 : a > b ? 1 : 0;
}

/** `(trace_id, call_id) IN` a JSON list of pairs bound as one parameter. */
function pairsIn(dialect: Dialect, param: number): string {
  return dialect === "sqlite"
    ? `(trace_id, call_id) IN (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]')
         FROM json_each($${param}))`
    : `(trace_id, call_id) IN (SELECT value ->> 0, value ->> 1
         FROM jsonb_array_elements($${param}::jsonb))`;
}

/**
 * Sums usage rows per key and model, in the database. `rows` selects, from what `ctes` defines,
 * `key` and `call_usage`'s columns (`USAGE_COLUMNS`); `$1` is the project. With costs, each
 * call is priced at the price in effect when it started: the project's own newest price dated
 * at or before the start if it has one, else the default's.
 */
async function sumUsage(
  sql: Sql,
  ctes: string,
  rows: string,
  params: SqlValue[],
  includeCosts: boolean,
): Promise<{ key: string; model: string; usage: ModelUsage }[]> {
  // Each price is in effect from its date until the next of the same model and scope.
  const periods = includeCosts
    ? `, price_periods AS (
         SELECT p.id, p.model, p.project_id, p.effective_date AS since,
           LEAD(p.effective_date) OVER (PARTITION BY p.model, p.project_id ORDER BY p.effective_date) AS until,
           p.prompt_token_cost, p.completion_token_cost,
           p.cache_read_input_token_cost, p.cache_creation_input_token_cost
         FROM prices p WHERE p.project_id = $1 OR p.project_id IS NULL)`
    : "";
  const inEffect = (alias: string, scope: string) =>
    `LEFT JOIN price_periods ${alias} ON ${alias}.project_id ${scope} AND ${alias}.model = r.model
       AND ${alias}.since <= r.started_at AND (${alias}.until IS NULL OR r.started_at < ${alias}.until)`;
  const cost = (column: string) =>
    `CASE WHEN own.id IS NOT NULL THEN COALESCE(own.${column}, 0) ELSE COALESCE(def.${column}, 0) END`;
  const costs = includeCosts
    ? `, SUM(r.prompt_tokens * ${cost("prompt_token_cost")}) AS prompt_cost,
         SUM(r.completion_tokens * ${cost("completion_token_cost")}) AS completion_cost,
         SUM(r.cache_read_input_tokens * ${cost("cache_read_input_token_cost")}) AS cache_read_cost,
         SUM(r.cache_creation_input_tokens * ${cost("cache_creation_input_token_cost")}) AS cache_creation_cost`
    : "";
  const result = await sql.query(
    `${ctes ? `${ctes},` : "WITH"} usage_rows AS (${rows})${periods}
     SELECT r.key, r.model,
       SUM(r.requests) AS requests,
       SUM(r.prompt_tokens) AS prompt_tokens,
       SUM(r.completion_tokens) AS completion_tokens,
       SUM(r.total_tokens) AS total_tokens,
       SUM(r.cache_read_input_tokens) AS cache_read_input_tokens,
       SUM(r.cache_creation_input_tokens) AS cache_creation_input_tokens
       ${costs}
     FROM usage_rows r
     ${includeCosts ? `${inEffect("own", "= $1")} ${inEffect("def", "IS NULL")}` : ""}
     GROUP BY r.key, r.model`,
    params,
  );
  return result.map((row) => {
    const { key, model, ...counts } = SUMS.read(row);
    const costs = includeCosts ? COSTS.read(row) : undefined;
    return {
      key,
      model,
      usage: {
        ...counts,
        prompt_tokens_total_cost: costs?.prompt_cost ?? null,
        completion_tokens_total_cost: costs?.completion_cost ?? null,
        cache_read_input_tokens_total_cost: costs?.cache_read_cost ?? null,
        cache_creation_input_tokens_total_cost: costs?.cache_creation_cost ?? null,
      },
    };
  });
}

/** `call_usage`'s summed columns, from alias `u`. */
const USAGE_SELECT = USAGE_COLUMNS.map((c) => `u.${c}`).join(", ");

/** A requested trace, as `callUsage` plans it. */
interface TraceUnit {
  trace_id: string;
  /** Its visible calls. */
  calls: number;
  /** Its visible calls without an end. */
  open: number;
  /** The requested id that is its root, when the trace's calls are exactly that root's
   * descendants (then they are read by trace, not by walking parent links). */
  root: string | null;
  /** The other requested ids in it: their descendants are found by their parent links. */
  walked: string[];
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
   * content → ConflictError. An end that arrived first is merged in. A key that cannot be kept
   * (NUL, a bad date) → InvalidInputError.
   */
  async startCall(start: CallStartInput): Promise<{ id: string; trace_id: string }> {
    const [result] = await this.upsertBatch([{ mode: "start", start }]);
    if (!result!.ok) throw result!.error;
    const { id, trace_id } = result as { id: string; trace_id: string };
    return { id, trace_id };
  }

  /** Records a call's end; before its start it is stored but stays invisible. */
  async endCall(end: CallEndInput): Promise<void> {
    const [result] = await this.upsertBatch([{ mode: "end", end }]);
    if (!result!.ok) throw result!.error;
  }

  /**
   * Applies starts and ends in order, in ONE transaction, and answers one result per item. An
   * item that cannot be stored (a key with NUL, a bad date: InvalidInputError; a start that
   * differs from the one stored or from an earlier one in the batch: ConflictError) is refused
   * alone: every other item is stored.
   */
  async upsertBatch(items: readonly CallBatchItem[]): Promise<CallBatchResult[]> {
    const now = this.#now();
    const results: (CallBatchResult | undefined)[] = new Array(items.length);
    const merged = new Map<string, Merged>();
    for (const [index, item] of items.entries()) {
      let prepared: PreparedStart | PreparedEnd;
      try {
        prepared =
          item.mode === "start" ? prepareStart(startOf(item), now) : prepareEnd(endOf(item));
      } catch (err) {
        if (!(err instanceof InvalidInputError)) throw err;
        results[index] = { ok: false, error: err };
        continue;
      }
      const mapKey = `${prepared.project_id}\u0000${prepared.id}`;
      let m = merged.get(mapKey);
      if (!m) {
        m = { project_id: prepared.project_id, id: prepared.id, startItems: [] };
        merged.set(mapKey, m);
      }
      if (item.mode === "start") {
        const s = prepared as PreparedStart;
        if (m.start && m.start.hash !== s.hash) {
          results[index] = {
            ok: false,
            error: new ConflictError(`Call ${s.id} is started twice in this batch, differently`),
          };
          continue;
        }
        m.start ??= s;
        m.startItems.push(index);
      } else {
        m.end = prepared as PreparedEnd;
        results[index] = { ok: true };
      }
    }
    // Key order: two concurrent batches touching the same calls lock them in the same order,
    // so PostgreSQL never deadlocks them against each other.
    const rows = [...merged.values()].sort(
      (a, b) => compare(a.project_id, b.project_id) || compare(a.id, b.id),
    );
    if (rows.length > 0)
      await this.#sql.transaction(async (tx) => {
        for (let i = 0; i < rows.length; ) {
          // One project per chunk.
          let j = i + 1;
          while (
            j < rows.length &&
            j - i < ROWS_PER_CHUNK &&
            rows[j]!.project_id === rows[i]!.project_id
          )
            j++;
          await this.#write(tx, rows.slice(i, j), results);
          i = j;
        }
      });
    return results as CallBatchResult[];
  }

  /** Writes one project's calls: starts checked against the stored ones, links, usage rows. */
  async #write(tx: Sql, rows: Merged[], results: (CallBatchResult | undefined)[]): Promise<void> {
    const d = tx.dialect;
    const project = rows[0]!.project_id;
    const ids = new Set(rows.map((r) => r.id));
    for (const r of rows) if (r.start?.parent_id) ids.add(r.start.parent_id);
    const stored = new Map<string, Stored>();
    for (const row of await tx.query(
      `SELECT ${STORED.columns()} FROM calls WHERE project_id = $1 AND ${inList(d, "id", 2)}`,
      [project, listParam([...ids])],
    )) {
      const s = STORED.read(row);
      stored.set(s.id, s);
    }

    // Starts: a repeat keeps the stored one (and its trace); a different one is refused.
    const fresh = new Map<string, Merged>();
    for (const r of rows) {
      if (!r.start) continue;
      const was = stored.get(r.id);
      if (was?.started) {
        if (was.start_hash !== r.start.hash) {
          const error = new ConflictError(`Call ${r.id} already exists with different content`);
          for (const index of r.startItems) results[index] = { ok: false, error };
          delete r.start;
          continue;
        }
        for (const index of r.startItems)
          results[index] = { ok: true, id: r.id, trace_id: was.trace_id ?? r.start.trace_id };
      } else {
        fresh.set(r.id, r);
        for (const index of r.startItems)
          results[index] = { ok: true, id: r.id, trace_id: r.start.trace_id };
      }
    }
    // Links of the calls started now: up each parent chain inside the batch until a call whose
    // link is known (no parent, a stored parent, one of another trace, or one linked already).
    for (const r of fresh.values()) {
      if (r.link !== undefined) continue;
      const chain: Merged[] = [];
      let top = 0;
      for (let at: Merged = r; ; ) {
        if (at.link !== undefined) {
          // Linked already, or on this chain (-1): a cycle, which links nothing.
          top = at.link > 0 ? 1 : 0;
          break;
        }
        at.link = -1;
        chain.push(at);
        const start = at.start!;
        if (start.parent_id === null) {
          top = 2;
          break;
        }
        const parent = fresh.get(start.parent_id);
        if (parent) {
          if (parent.start!.trace_id !== start.trace_id) break;
          at = parent;
          continue;
        }
        const was = stored.get(start.parent_id);
        top =
          was?.started && was.deleted_at === null && was.trace_id === start.trace_id && was.link > 0
            ? 1
            : 0;
        break;
      }
      // A parentless call is 2; below a linked call, 1.
      for (const [k, c] of chain.entries()) {
        c.link = k === chain.length - 1 ? top : top > 0 ? 1 : 0;
      }
    }

    // Each row as stored after the write (RETURNING), in this transaction's view: its trace
    // (the first stored, for a start without trace_id sent twice at once), whether it is
    // visible and ended (a call deleted meanwhile is not), and its usage.
    const after = new Map<string, RowOf<typeof WRITTEN>>();
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
          e?.usage_rows ?? null,
          s && fresh.has(r.id) ? Math.max(0, r.link ?? 0) : 0,
          s ? 1 : 0,
          s?.hash ?? null,
        );
      }
      for (const row of await tx.query(upsertText(chunk.length), params)) {
        const written = WRITTEN.read(row);
        after.set(written.id, written);
      }
    }
    for (const r of fresh.values()) {
      if (!r.start!.trace_generated) continue;
      r.start!.trace_id = after.get(r.id)?.trace_id ?? r.start!.trace_id;
      for (const index of r.startItems)
        results[index] = { ok: true, id: r.id, trace_id: r.start!.trace_id };
    }

    // Calls stored earlier whose parent is linked now (they arrived before it) link in turn,
    // and their descendants in the same trace with them, a level at a time. The unlinked calls
    // are few and indexed, so a level that finds none costs one probe per parent.
    let parents = new Map(
      [...fresh.values()]
        .filter((r) => (r.link ?? 0) > 0)
        .map((r) => [r.id, after.get(r.id)?.trace_id ?? r.start!.trace_id]),
    );
    while (parents.size > 0) {
      const children = await tx.query(
        `SELECT ${CALL_PARENT.columns()} FROM calls
         WHERE project_id = $1 AND link = 0 AND parent_id IS NOT NULL AND started = 1
           AND deleted_at IS NULL AND ${inList(d, "parent_id", 2)}`,
        [project, listParam([...parents.keys()])],
      );
      const next = new Map<string, string>();
      for (const c of children.map(CALL_PARENT.read))
        if (parents.get(c.parent_id!) === c.trace_id) next.set(c.id, c.trace_id);
      if (next.size > 0)
        await tx.exec(`UPDATE calls SET link = 1 WHERE project_id = $1 AND ${inList(d, "id", 2)}`, [
          project,
          listParam([...next.keys()]),
        ]);
      parents = next;
    }

    // Usage rows of every call that ended now, or started now after its end: replaced whole,
    // from the call as stored.
    const replaced: [string, string][] = [];
    const usage: SqlValue[][] = [];
    for (const r of rows) {
      const was = stored.get(r.id);
      if (!(r.end || (fresh.has(r.id) && was && was.ended_at !== null))) continue;
      const row = after.get(r.id);
      if (!row?.started || row.trace_id === null) continue;
      const trace = row.trace_id;
      replaced.push([trace, r.id]);
      if (row.deleted_at !== null || row.ended_at === null || row.usage_rows === null) continue;
      for (const [seq, [model, ...counts]] of row.usage_rows.entries())
        usage.push([project, trace, r.id, seq, model, row.started_at!, ...counts]);
    }
    if (replaced.length > 0)
      await tx.exec(`DELETE FROM call_usage WHERE project_id = $1 AND ${pairsIn(d, 2)}`, [
        project,
        JSON.stringify(replaced),
      ]);
    const columns = `project_id, trace_id, call_id, seq, ${USAGE_COLUMNS.join(", ")}`;
    if (d === "postgres") {
      // One JSON parameter: binding 12 parameters a row cost PostgreSQL more than parsing.
      for (let i = 0; i < usage.length; i += 5000) {
        await tx.exec(
          `INSERT INTO call_usage (${columns})
           SELECT $1, r.t, r.c, r.s, r.m, r.a, r.q, r.p, r.o, r.x, r.cr, r.cc
           FROM jsonb_to_recordset($2::jsonb) AS r(t text, c text, s int, m text, a text,
             q float8, p float8, o float8, x float8, cr float8, cc float8)`,
          [
            project,
            JSON.stringify(
              usage.slice(i, i + 5000).map(([, t, c, seq, m, a, q, p, o, x, cr, cc]) => ({
                t,
                c,
                s: seq,
                m,
                a,
                q,
                p,
                o,
                x,
                cr,
                cc,
              })),
            ),
          ],
        );
      }
    } else {
      const width = 4 + USAGE_COLUMNS.length;
      for (let i = 0; i < usage.length; i += ROWS_PER_STATEMENT) {
        const chunk = usage.slice(i, i + ROWS_PER_STATEMENT);
        const values = chunk
          .map(
            (_, r) =>
              `(${Array.from({ length: width }, (_, c) => `$${r * width + c + 1}`).join(", ")})`,
          )
          .join(", ");
        await tx.exec(`INSERT INTO call_usage (${columns}) VALUES ${values}`, chunk.flat());
      }
    }
  }

  /** A visible (started, not deleted) call of this project. */
  async getCall(projectId: string, id: string): Promise<Call | undefined> {
    const row = await this.#sql.one(
      `SELECT ${CALLS.columns()} FROM calls
       WHERE project_id = $1 AND id = $2 AND started = 1 AND deleted_at IS NULL`,
      [projectId, id],
    );
    return row ? CALLS.read(row) : undefined;
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
      `SELECT ${CALLS.columns()} FROM calls WHERE ${where.join(" AND ")}
       ORDER BY started_at, id LIMIT $${params.length - 1} OFFSET $${params.length}`,
      params,
    );
    return rows.map(CALLS.read);
  }

  /** Marks the calls and all their descendants deleted; returns how many were newly marked. */
  async deleteCalls(projectId: string, ids: readonly string[]): Promise<number> {
    if (ids.length === 0) return 0;
    const d = this.#sql.dialect;
    const params = [projectId, listParam(ids), new Date(this.#now()).toISOString()];
    return this.#sql.transaction(async (tx) => {
      const deleted = await tx.exec(
        `WITH RECURSIVE tree(id) AS (
           SELECT id FROM calls
           WHERE project_id = $1 AND ${inList(d, "id", 2)} AND started = 1 AND deleted_at IS NULL
           UNION
           SELECT c.id FROM tree t CROSS JOIN calls c
           WHERE c.project_id = $1 AND c.parent_id = t.id AND c.started = 1 AND c.deleted_at IS NULL
         )
         UPDATE calls SET deleted_at = $3
         WHERE project_id = $1 AND id IN (SELECT id FROM tree) AND deleted_at IS NULL`,
        params,
      );
      // Their usage rows go with them: sums read call_usage alone. The walk reads the calls
      // marked now (and any deleted before under them, whose rows are gone already).
      if (deleted > 0)
        await tx.exec(
          `WITH RECURSIVE tree(id, trace_id) AS (
             SELECT id, trace_id FROM calls
             WHERE project_id = $1 AND ${inList(d, "id", 2)} AND started = 1 AND deleted_at = $3
             UNION
             SELECT c.id, c.trace_id FROM tree t CROSS JOIN calls c
             WHERE c.project_id = $1 AND c.parent_id = t.id AND c.started = 1
               AND c.deleted_at IS NOT NULL
           )
           DELETE FROM call_usage
           WHERE project_id = $1 AND trace_id IN (SELECT trace_id FROM tree)
             AND call_id IN (SELECT id FROM tree)`,
          params,
        );
      return deleted;
    });
  }

  /**
   * Usage per requested call (its own plus every descendant's), per model, summed in the
   * database, in batches of at most `limit` calls (default 10,000).
   *
   * The requested calls' traces are counted first and packed whole into batches; a batch reads
   * its traces' calls (and, when a parent chain leaves them, the descendants of the requested
   * calls in other traces) and sums them. A batch that turns out larger than `limit` is halved
   * and each half retried; a single trace that does not fit throws LimitExceededError, before
   * any answer is given: sums are never partial. A call counts once per batch however many
   * requested ids share it, and each requested id gets all of its descendants. Everything is
   * read in one snapshot.
   *
   * A requested trace root whose trace is exactly its descendants (every call of the trace
   * linked to it, none with a child in another trace: see migration 5) is summed by trace from
   * `call_usage`, without walking parent links; any other requested id walks them.
   */
  async callUsage(
    projectId: string,
    callIds: readonly string[],
    options: { includeCosts?: boolean; limit?: number } = {},
  ): Promise<CallUsageResult> {
    return this.#sql.transaction((tx) => this.#callUsage(tx, projectId, callIds, options), {
      readOnly: true,
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
    const rows = `SELECT substr(u.started_at, 1, 10) AS key, ${USAGE_SELECT} FROM call_usage u
      WHERE u.project_id = $1 AND u.started_at >= $2 AND u.started_at < $3`;
    const params = [projectId, `${startDate}T00:00:00.000Z`, next.toISOString()];
    const sums = await sumUsage(this.#sql, "", rows, params, options.includeCosts ?? false);
    sums.sort((a, b) => compare(a.key, b.key) || compare(a.model, b.model));
    const days: Record<string, Record<string, ModelUsage>> = Object.create(null);
    for (const r of sums) {
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
    const limit = Math.max(1, Math.floor(options.limit ?? 10000));
    const includeCosts = options.includeCosts ?? false;

    const requested = (
      await sql.query(
        `SELECT ${REQUESTED.columns()} FROM calls
         WHERE project_id = $1 AND ${inList(d, "id", 2)} AND started = 1 AND deleted_at IS NULL`,
        [projectId, listParam(distinct)],
      )
    ).map(REQUESTED.read);
    if (requested.length === 0) return result;
    const traceIds = [...new Set(requested.map((r) => r.trace_id))];
    const traces = listParam(traceIds);
    const shapes = await sql.query(
      `SELECT trace_id, COUNT(*) AS n,
         SUM(CASE WHEN link = 0 THEN 1 ELSE 0 END) AS unlinked,
         SUM(CASE WHEN link = 2 THEN 1 ELSE 0 END) AS roots,
         SUM(CASE WHEN ended_at IS NULL THEN 1 ELSE 0 END) AS open
       FROM calls WHERE project_id = $1 AND ${inList(d, "trace_id", 2)}
         AND started = 1 AND deleted_at IS NULL
       GROUP BY trace_id`,
      [projectId, traces],
    );
    // Traces with a call whose child lies in another trace: such a child is never linked, so
    // the few unlinked calls of the project are all there is to look at.
    const crossing = new Set(
      (
        await sql.query(
          `SELECT DISTINCT p.trace_id FROM calls c CROSS JOIN calls p
           WHERE c.project_id = $1 AND c.link = 0 AND c.parent_id IS NOT NULL
             AND c.started = 1 AND c.deleted_at IS NULL
             AND p.project_id = $1 AND p.id = c.parent_id AND p.started = 1
             AND p.deleted_at IS NULL AND p.trace_id <> c.trace_id
             AND ${inList(d, "p.trace_id", 2)}`,
          [projectId, traces],
        )
      ).map((r) => CALL_TRACE.read(r).trace_id),
    );
    const units = new Map<string, TraceUnit>();
    const exact = new Set<string>();
    for (const s of shapes.map(TRACE_SHAPE.read)) {
      const trace = s.trace_id;
      if (s.unlinked === 0 && s.roots === 1 && !crossing.has(trace)) exact.add(trace);
      units.set(trace, { trace_id: trace, calls: s.n, open: s.open, root: null, walked: [] });
    }
    for (const r of requested) {
      const unit = units.get(r.trace_id)!;
      // The only link-2 call of an exact trace is its root.
      if (r.link === 2 && exact.has(r.trace_id)) unit.root = r.id;
      else unit.walked.push(r.id);
    }
    const ordered = [...units.values()].sort((a, b) => compare(a.trace_id, b.trace_id));
    for (const u of ordered)
      if (u.calls > limit) throw new LimitExceededError(u.calls, limit, u.trace_id);

    // Whole traces, packed in order into batches of at most `limit` calls.
    const pending: TraceUnit[][] = [];
    let batch: TraceUnit[] = [];
    let size = 0;
    for (const u of ordered) {
      if (size + u.calls > limit && batch.length > 0) {
        pending.push(batch);
        batch = [];
        size = 0;
      }
      batch.push(u);
      size += u.calls;
    }
    if (batch.length > 0) pending.push(batch);
    pending.reverse();

    const unfinished = new Set<string>();
    while (pending.length > 0) {
      const next = pending.pop()!;
      const done = await this.#usageBatch(sql, projectId, next, limit, includeCosts);
      if ("overflow" in done) {
        if (next.length === 1)
          throw new LimitExceededError(done.overflow, limit, next[0]!.trace_id);
        const half = Math.ceil(next.length / 2);
        pending.push(next.slice(half), next.slice(0, half));
        continue;
      }
      for (const r of done.sums) {
        const usage = result.call_usage[r.key];
        if (usage) usage[r.model] = r.usage;
      }
      for (const id of done.unfinished) unfinished.add(id);
    }
    // Sorted here, not in SQL: a database collation may not order like code points.
    result.unfinished_call_ids = [...unfinished].sort(compare);
    return result;
  }

  /** One batch of whole traces: its sums per requested id and model, and its calls without an
   * end; or, when the calls it would read outnumber `limit`, how many they are. */
  async #usageBatch(
    sql: Sql,
    projectId: string,
    units: TraceUnit[],
    limit: number,
    includeCosts: boolean,
  ): Promise<
    | { overflow: number }
    | { sums: { key: string; model: string; usage: ModelUsage }[]; unfinished: string[] }
  > {
    const d = sql.dialect;
    const sums: { key: string; model: string; usage: ModelUsage }[] = [];
    const unfinished: string[] = [];
    const read = units.reduce((n, u) => n + u.calls, 0);

    const walked = units.flatMap((u) => u.walked);
    if (walked.length > 0) {
      // CROSS JOIN pins the join order on SQLite (tree outside, the parent index inside).
      const tree = `WITH RECURSIVE tree(root_id, id, trace_id, open) AS (
          SELECT c.id, c.id, c.trace_id, CASE WHEN c.ended_at IS NULL THEN 1 ELSE 0 END
          FROM calls c
          WHERE c.project_id = $1 AND ${inList(d, "c.id", 2)} AND c.started = 1 AND c.deleted_at IS NULL
          UNION
          SELECT t.root_id, c.id, c.trace_id, CASE WHEN c.ended_at IS NULL THEN 1 ELSE 0 END
          FROM tree t CROSS JOIN calls c
          WHERE c.project_id = $1 AND c.parent_id = t.id AND c.started = 1 AND c.deleted_at IS NULL
        )`;
      const params = [projectId, listParam(walked)];
      // Descendants outside the batch's traces count too.
      const count = WALK_COUNT.read(
        (await sql.one(
          `${tree} SELECT COUNT(DISTINCT CASE WHEN NOT (${inList(d, "trace_id", 3)}) THEN id END) AS outside,
             SUM(open) AS open FROM tree`,
          [...params, listParam(units.map((u) => u.trace_id))],
        ))!,
      );
      const total = read + count.outside;
      if (total > limit) return { overflow: total };
      sums.push(
        ...(await sumUsage(
          sql,
          tree,
          `SELECT t.root_id AS key, ${USAGE_SELECT} FROM tree t CROSS JOIN call_usage u
           WHERE u.project_id = $1 AND u.trace_id = t.trace_id AND u.call_id = t.id`,
          params,
          includeCosts,
        )),
      );
      if ((count.open ?? 0) > 0) {
        const open = await sql.query(`${tree} SELECT DISTINCT id FROM tree WHERE open = 1`, params);
        for (const o of open) unfinished.push(CALL_ID.read(o).id);
      }
    }

    const rooted = units.filter((u) => u.root !== null);
    if (rooted.length > 0) {
      const rootOf = new Map(rooted.map((u) => [u.trace_id, u.root!]));
      const params = [projectId, listParam(rooted.map((u) => u.trace_id))];
      for (const r of await sumUsage(
        sql,
        "",
        `SELECT u.trace_id AS key, ${USAGE_SELECT} FROM call_usage u
         WHERE u.project_id = $1 AND ${inList(d, "u.trace_id", 2)}`,
        params,
        includeCosts,
      ))
        sums.push({ ...r, key: rootOf.get(r.key)! });
      const open = rooted.filter((u) => u.open > 0).map((u) => u.trace_id);
      if (open.length > 0) {
        const rows = await sql.query(
          `SELECT id FROM calls WHERE project_id = $1 AND ${inList(d, "trace_id", 2)}
             AND started = 1 AND deleted_at IS NULL AND ended_at IS NULL`,
          [projectId, listParam(open)],
        );
        for (const o of rows) unfinished.push(CALL_ID.read(o).id);
      }
    }
    return { sums, unfinished };
  }
}
