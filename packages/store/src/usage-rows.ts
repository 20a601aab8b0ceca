/**
 * A call's own usage as aggregation counts it, worked out once, when the call ends: one row per
 * model of `summary.usage`. `summary` itself is free-form and kept as sent; nothing in it can
 * make ingestion or aggregation fail.
 */

/** One model's usage by one call: the numbers every sum adds up. */
export interface UsageRow {
  model: string;
  requests: number;
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  cache_read_input_tokens: number;
  cache_creation_input_tokens: number;
}

/** The most models one call's usage counts (in the order sent); the rest are ignored. */
export const MAX_USAGE_MODELS = 1024;

function isPlainObject(value: unknown): value is Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

/** Text PostgreSQL can keep (no NUL) and that is well-formed UTF-16, as every store keeps it. */
export function storableText(value: string): string {
  return value.replaceAll("\u0000", "\ufffd").toWellFormed();
}

/**
 * `summary.usage` (model → that model's usage) read leniently: a summary or usage that is not an
 * object, or a model entry that is not one, contributes nothing; a field that is not a finite
 * number counts 0. `input_tokens` adds to `prompt_tokens` and `output_tokens` to
 * `completion_tokens`; `total_tokens` counts prompt + completion when it is absent or not
 * positive; `requests` is 1 unless given as a number. An entry left with only zeros (tokens and
 * requests alike, the default request aside) is dropped.
 */
export function usageRowsOf(summary: unknown): UsageRow[] {
  if (!isPlainObject(summary)) return [];
  const usage = summary.usage;
  if (!isPlainObject(usage)) return [];
  const rows = new Map<string, UsageRow>();
  let models = 0;
  for (const [name, entry] of Object.entries(usage)) {
    if (++models > MAX_USAGE_MODELS) break;
    if (!isPlainObject(entry)) continue;
    const given = (key: string) => {
      const n = entry[key];
      return typeof n === "number" && Number.isFinite(n) ? n : undefined;
    };
    const n = (key: string) => given(key) ?? 0;
    const prompt = n("prompt_tokens") + n("input_tokens");
    const completion = n("completion_tokens") + n("output_tokens");
    const totalGiven = n("total_tokens");
    const row: UsageRow = {
      model: storableText(name),
      requests: given("requests") ?? 1,
      prompt_tokens: prompt,
      completion_tokens: completion,
      total_tokens: totalGiven > 0 ? totalGiven : prompt + completion,
      cache_read_input_tokens: n("cache_read_input_tokens"),
      cache_creation_input_tokens: n("cache_creation_input_tokens"),
    };
    const counted =
      (given("requests") ?? 0) !== 0 ||
      row.prompt_tokens !== 0 ||
      row.completion_tokens !== 0 ||
      row.total_tokens !== 0 ||
      row.cache_read_input_tokens !== 0 ||
      row.cache_creation_input_tokens !== 0;
    if (!counted) continue;
    // Two names that differ only by a NUL or a lone surrogate become one: their sums add up.
    const same = rows.get(row.model);
    if (same) {
      same.requests += row.requests;
      same.prompt_tokens += row.prompt_tokens;
      same.completion_tokens += row.completion_tokens;
      same.total_tokens += row.total_tokens;
      same.cache_read_input_tokens += row.cache_read_input_tokens;
      same.cache_creation_input_tokens += row.cache_creation_input_tokens;
    } else rows.set(row.model, row);
  }
  return [...rows.values()];
}

/** The rows as the `calls.usage_rows` column keeps them (null for none): a JSON array of
 * `[model, requests, prompt, completion, total, cache read, cache creation]`. */
export function usageRowsJson(rows: readonly UsageRow[]): string | null {
  if (rows.length === 0) return null;
  return JSON.stringify(
    rows.map((r) => [
      r.model,
      r.requests,
      r.prompt_tokens,
      r.completion_tokens,
      r.total_tokens,
      r.cache_read_input_tokens,
      r.cache_creation_input_tokens,
    ]),
  );
}

/** The columns of `call_usage` a sum reads, after `project_id, trace_id, call_id, seq`. */
export const USAGE_COLUMNS = [
  "model",
  "started_at",
  "requests",
  "prompt_tokens",
  "completion_tokens",
  "total_tokens",
  "cache_read_input_tokens",
  "cache_creation_input_tokens",
] as const;

/**
 * `INSERT INTO call_usage` of the `usage_rows` of the visible, ended calls `c` that `where`
 * selects (it may use the statement's parameters): each call's rows carry its trace and start,
 * so a trace's usage is read as one range, and a call's price is found by when it started.
 */
export function insertUsageRows(dialect: "sqlite" | "postgres", where: string): string {
  const columns = `project_id, trace_id, call_id, seq, ${USAGE_COLUMNS.join(", ")}`;
  const visible = `c.started = 1 AND c.deleted_at IS NULL AND c.ended_at IS NOT NULL
    AND c.usage_rows IS NOT NULL AND ${where}`;
  if (dialect === "sqlite") {
    const at = (i: number) => `json_extract(j.value, '$[${i}]')`;
    return `INSERT INTO call_usage (${columns})
      SELECT c.project_id, c.trace_id, c.id, CAST(j.key AS INTEGER), ${at(0)}, c.started_at,
        ${at(1)}, ${at(2)}, ${at(3)}, ${at(4)}, ${at(5)}, ${at(6)}
      FROM calls c CROSS JOIN json_each(c.usage_rows) j
      WHERE ${visible}`;
  }
  const at = (i: number) => `(j.v ->> ${i})::float8`;
  return `INSERT INTO call_usage (${columns})
    SELECT c.project_id, c.trace_id, c.id, (j.seq - 1)::int, j.v ->> 0, c.started_at,
      ${at(1)}, ${at(2)}, ${at(3)}, ${at(4)}, ${at(5)}, ${at(6)}
    FROM calls c
    CROSS JOIN LATERAL jsonb_array_elements(c.usage_rows::jsonb) WITH ORDINALITY AS j(v, seq)
    WHERE ${visible}`;
}
