import type { Json } from "./common.ts";
import { eventStep } from "./jobs.ts";
import { json, num, rowSchema, str, strOrNull } from "./rows.ts";
import { inList, listParam, type Sql } from "./sql.ts";
import { insertUsageRows, usageRowsJson, usageRowsOf } from "./usage-rows.ts";

export interface Migration {
  version: number;
  name: string;
  /** DDL: a string both SQLite and PostgreSQL accept, or one statement per dialect (a dialect
   * left out runs nothing: a table only one dialect's implementation uses). */
  statements: readonly (string | { sqlite?: string; postgres?: string })[];
  /** Data to carry over, after the statements, in the same transaction. */
  run?: (tx: Sql) => Promise<void>;
}

/** `call_usage`'s columns: the sums' key (`project_id, trace_id, call_id, seq`), the model and
 * the call's start (for its price), and the numbers. */
const CALL_USAGE_COLUMNS = `
  project_id TEXT NOT NULL,
  trace_id TEXT NOT NULL,
  call_id TEXT NOT NULL,
  seq INTEGER NOT NULL,
  model TEXT NOT NULL,
  started_at TEXT NOT NULL,
  requests DOUBLE PRECISION NOT NULL,
  prompt_tokens DOUBLE PRECISION NOT NULL,
  completion_tokens DOUBLE PRECISION NOT NULL,
  total_tokens DOUBLE PRECISION NOT NULL,
  cache_read_input_tokens DOUBLE PRECISION NOT NULL,
  cache_creation_input_tokens DOUBLE PRECISION NOT NULL,
  PRIMARY KEY (project_id, trace_id, call_id, seq)`;

export const MIGRATIONS: readonly Migration[] = [
  {
    version: 1,
    name: "identity, models, checkpoints, jobs, events, datasets",
    statements: [
      `CREATE TABLE entities (
        name TEXT PRIMARY KEY,
        created_at BIGINT NOT NULL
      )`,
      `CREATE TABLE users (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        default_entity TEXT NOT NULL REFERENCES entities(name),
        created_at BIGINT NOT NULL
      )`,
      `CREATE TABLE memberships (
        user_id TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
        entity TEXT NOT NULL REFERENCES entities(name) ON DELETE CASCADE,
        role TEXT NOT NULL DEFAULT 'member',
        created_at BIGINT NOT NULL,
        PRIMARY KEY (user_id, entity)
      )`,
      "CREATE INDEX memberships_entity ON memberships (entity)",
      `CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        user_id TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
        name TEXT,
        prefix TEXT NOT NULL,
        hash TEXT NOT NULL UNIQUE,
        created_at BIGINT NOT NULL,
        last_used_at BIGINT,
        revoked_at BIGINT
      )`,
      "CREATE INDEX api_keys_user ON api_keys (user_id, id)",
      `CREATE TABLE models (
        id TEXT PRIMARY KEY,
        entity TEXT NOT NULL REFERENCES entities(name),
        project TEXT NOT NULL,
        name TEXT NOT NULL,
        base_model TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        latest_step INTEGER,
        UNIQUE (entity, project, name)
      )`,
      "CREATE INDEX models_entity ON models (entity, id)",
      `CREATE TABLE checkpoints (
        id TEXT PRIMARY KEY,
        model_id TEXT NOT NULL REFERENCES models(id) ON DELETE CASCADE,
        step INTEGER NOT NULL,
        metrics TEXT NOT NULL DEFAULT '{}',
        blob_key TEXT,
        created_at BIGINT NOT NULL,
        UNIQUE (model_id, step)
      )`,
      `CREATE TABLE training_jobs (
        id TEXT PRIMARY KEY,
        type TEXT NOT NULL CHECK (type IN ('rl', 'sft')),
        model_id TEXT NOT NULL REFERENCES models(id) ON DELETE CASCADE,
        entity TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
        config TEXT NOT NULL DEFAULT '{}',
        payload_ref TEXT,
        created_at BIGINT NOT NULL,
        training_start BIGINT,
        training_end BIGINT,
        error_message TEXT,
        step_from INTEGER,
        step_to INTEGER,
        lease_owner TEXT,
        lease_expires_at BIGINT,
        attempts INTEGER NOT NULL DEFAULT 0
      )`,
      "CREATE INDEX training_jobs_status ON training_jobs (status, id)",
      "CREATE INDEX training_jobs_model ON training_jobs (model_id, status, id)",
      "CREATE INDEX training_jobs_entity ON training_jobs (entity, id)",
      // The database itself refuses a second running job of one model, whatever the claimer does.
      "CREATE UNIQUE INDEX training_jobs_one_running ON training_jobs (model_id) WHERE status = 'running'",
      `CREATE TABLE job_events (
        job_id TEXT NOT NULL REFERENCES training_jobs(id) ON DELETE CASCADE,
        sequence INTEGER NOT NULL,
        id TEXT NOT NULL UNIQUE,
        type TEXT NOT NULL,
        data TEXT NOT NULL DEFAULT '{}',
        created_at BIGINT NOT NULL,
        PRIMARY KEY (job_id, sequence)
      )`,
      `CREATE TABLE datasets (
        id TEXT PRIMARY KEY,
        entity TEXT NOT NULL REFERENCES entities(name),
        name TEXT,
        blob_key TEXT NOT NULL,
        bytes BIGINT NOT NULL,
        lines INTEGER NOT NULL,
        created_at BIGINT NOT NULL
      )`,
      "CREATE INDEX datasets_entity ON datasets (entity, id)",
    ],
  },
  {
    version: 2,
    name: "calls and prices",
    statements: [
      // `started` = 0 holds an end that arrived before its start: stored, but invisible.
      `CREATE TABLE calls (
        project_id TEXT NOT NULL,
        id TEXT NOT NULL,
        trace_id TEXT,
        parent_id TEXT,
        op_name TEXT,
        display_name TEXT,
        started_at TEXT,
        ended_at TEXT,
        inputs TEXT,
        output TEXT,
        exception TEXT,
        attributes TEXT,
        summary TEXT,
        deleted_at TEXT,
        started INTEGER NOT NULL DEFAULT 0,
        start_hash TEXT,
        PRIMARY KEY (project_id, id)
      )`,
      "CREATE INDEX calls_trace ON calls (project_id, trace_id)",
      "CREATE INDEX calls_parent ON calls (project_id, parent_id)",
      "CREATE INDEX calls_started_at ON calls (project_id, started_at)",
      `CREATE TABLE prices (
        id TEXT PRIMARY KEY,
        model TEXT NOT NULL,
        project_id TEXT,
        prompt_token_cost DOUBLE PRECISION NOT NULL,
        completion_token_cost DOUBLE PRECISION NOT NULL,
        cache_read_input_token_cost DOUBLE PRECISION,
        cache_creation_input_token_cost DOUBLE PRECISION,
        effective_date TEXT NOT NULL,
        created_at BIGINT NOT NULL
      )`,
      "CREATE INDEX prices_model ON prices (model, project_id, effective_date)",
    ],
  },
  {
    version: 3,
    name: "training job crashes",
    statements: [
      // Claims that ended with their worker dead (a lease that expired, a worker that restarted):
      // a job that kills its worker twice is failed, not retried forever.
      "ALTER TABLE training_jobs ADD COLUMN crashes INTEGER NOT NULL DEFAULT 0",
    ],
  },
  {
    version: 4,
    name: "calls: usage kept apart from the free-form summary",
    statements: [
      // `summary.usage` as aggregation reads it, extracted at ingestion: model → numeric fields
      // only. The summary itself stays as sent, whatever it holds.
      "ALTER TABLE calls ADD COLUMN usage_json TEXT",
    ],
  },
  {
    version: 5,
    name: "calls: usage rows per call and model, and each trace's shape",
    statements: [
      // The call's own usage as aggregation counts it (`usageRowsOf`), written with its end;
      // it replaces usage_json (model → raw numbers), which every sum re-read as JSON.
      "ALTER TABLE calls ADD COLUMN usage_rows TEXT",
      "ALTER TABLE calls DROP COLUMN usage_json",
      // 2: no parent. 1: the parent is a visible call of the same trace whose link is > 0 (so
      // the parent chain reaches a link-2 call inside the trace, through calls that arrived
      // earlier: no cycle can be linked). 0: anything else, until its parent links.
      "ALTER TABLE calls ADD COLUMN link INTEGER NOT NULL DEFAULT 0",
      // One row per visible, ended call and model: a trace's usage is one range of this table.
      {
        sqlite: `CREATE TABLE call_usage (${CALL_USAGE_COLUMNS}) WITHOUT ROWID`,
        postgres: `CREATE TABLE call_usage (${CALL_USAGE_COLUMNS})`,
      },
      "CREATE INDEX call_usage_started ON call_usage (project_id, started_at)",
      // A trace's visible calls, their links and ends, counted from the index alone. On
      // PostgreSQL the rest is INCLUDEd, not keyed (nor a partial index): without statistics
      // its planner would take any index led by project_id with more keys matched for a query
      // of a project's visible calls by id, and filter the ids row by row over the project.
      "DROP INDEX calls_trace",
      {
        sqlite:
          "CREATE INDEX calls_trace ON calls (project_id, trace_id, started, deleted_at, link, ended_at)",
        postgres:
          "CREATE INDEX calls_trace ON calls (project_id, trace_id) INCLUDE (started, deleted_at, link, ended_at)",
      },
      // The visible calls not linked to their trace's root: few, read to find the calls whose
      // parent lies in another trace.
      `CREATE INDEX calls_unlinked ON calls (project_id, parent_id)
        WHERE link = 0 AND parent_id IS NOT NULL AND started = 1 AND deleted_at IS NULL`,
    ],
    run: backfillUsageAndLinks,
  },
  {
    version: 6,
    name: "job events: one report per step",
    statements: [
      // The step a `gradient_step` or `checkpoint_saved` event reports (`eventStep`), null for
      // the other types: a job's second report of a step (a resumed run training it again) is
      // refused by the key and ignored.
      "ALTER TABLE job_events ADD COLUMN step INTEGER",
      "CREATE UNIQUE INDEX job_events_step ON job_events (job_id, type, step) WHERE step IS NOT NULL",
    ],
    run: backfillEventSteps,
  },
  {
    version: 7,
    name: "blobs and rate limits in PostgreSQL",
    statements: [
      // PgBlobStore (ADR 39): a key names one written version of its bytes, kept as chunk rows
      // of that version; a put writes the chunks and swaps the key in one transaction. Keys
      // compare bytewise (COLLATE "C"), so a prefix is one index range and lists sort as the
      // data directory's do. SQLite keeps blobs in the data directory.
      {
        postgres: `CREATE TABLE blobs (
          key TEXT COLLATE "C" PRIMARY KEY,
          version TEXT NOT NULL,
          bytes BIGINT NOT NULL,
          chunks INTEGER NOT NULL,
          modified_at BIGINT NOT NULL
        )`,
      },
      {
        postgres: `CREATE TABLE blob_chunks (
          key TEXT COLLATE "C" NOT NULL,
          version TEXT NOT NULL,
          seq INTEGER NOT NULL,
          data BYTEA NOT NULL,
          PRIMARY KEY (key, version, seq)
        )`,
      },
      // Weights do not compress: store chunks out of line without trying to.
      { postgres: "ALTER TABLE blob_chunks ALTER COLUMN data SET STORAGE EXTERNAL" },
      // Shared rate limits (ADR 39): a row per name (`key:<id>`, `project:<id>`), locked by
      // each check: its token bucket (tokens null: never drawn from, so full), and the mutex of
      // the name's concurrency slots, which are leases that lapse unless renewed.
      {
        postgres: `CREATE TABLE rate_buckets (
          name TEXT PRIMARY KEY,
          tokens DOUBLE PRECISION,
          updated_at BIGINT NOT NULL
        )`,
      },
      {
        postgres: `CREATE TABLE rate_leases (
          name TEXT NOT NULL,
          lease TEXT NOT NULL,
          expires_at BIGINT NOT NULL,
          PRIMARY KEY (name, lease)
        )`,
      },
    ],
  },
  {
    version: 8,
    name: "operator keys",
    statements: [
      // 1: an operator's key, which may read what spans every tenant (/metrics, ADR 50). Any
      // key of an admin of entity `default` could before; now only these can.
      "ALTER TABLE api_keys ADD COLUMN operator INTEGER NOT NULL DEFAULT 0",
      // The first-start admin's keys stay operators' (its key file is the documented scrape
      // credential); other admins of `default` are tenants' admins, not the operator.
      `UPDATE api_keys SET operator = 1 WHERE user_id IN
        (SELECT id FROM users WHERE name = 'admin' AND default_entity = 'default')`,
    ],
  },
  {
    version: 9,
    name: "native training runs (ADR 57)",
    statements: [
      `CREATE TABLE training_runs (
        id TEXT PRIMARY KEY,
        entity TEXT NOT NULL REFERENCES entities(name) ON DELETE CASCADE,
        request_id TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        run_name TEXT,
        spec TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('open', 'closing', 'closed', 'failed')),
        next_sequence_id BIGINT NOT NULL,
        projected_version BIGINT NOT NULL,
        committed_version BIGINT NOT NULL,
        state_key TEXT,
        grad_key TEXT,
        created_at BIGINT NOT NULL,
        lease_owner TEXT,
        lease_expires_at BIGINT,
        UNIQUE (entity, request_id),
        UNIQUE (entity, run_name)
      )`,
      `CREATE TABLE training_operations (
        id TEXT PRIMARY KEY,
        run_id TEXT NOT NULL REFERENCES training_runs(id) ON DELETE CASCADE,
        request_id TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        sequence_id BIGINT NOT NULL,
        kind TEXT NOT NULL,
        body TEXT NOT NULL,
        resolved TEXT,
        status TEXT NOT NULL
          CHECK (status IN ('admitted', 'running', 'succeeded', 'failed', 'cancelled')),
        parent_version BIGINT NOT NULL,
        reserved_version BIGINT,
        admitted_at BIGINT NOT NULL,
        started_at BIGINT,
        ended_at BIGINT,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        event_cursor INTEGER NOT NULL,
        open_gradient INTEGER NOT NULL DEFAULT 0,
        contributes TEXT NOT NULL,
        result TEXT,
        result_id TEXT,
        result_expires_at BIGINT,
        error_code TEXT,
        UNIQUE (run_id, request_id),
        UNIQUE (run_id, sequence_id)
      )`,
      "CREATE INDEX training_operations_unfinished ON training_operations (run_id, status)",
      `CREATE TABLE training_saved_states (
        id TEXT PRIMARY KEY,
        entity TEXT NOT NULL REFERENCES entities(name) ON DELETE CASCADE,
        run_id TEXT NOT NULL,
        name TEXT NOT NULL,
        spec TEXT NOT NULL,
        learner_version BIGINT NOT NULL,
        state_key TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        expires_at BIGINT,
        UNIQUE (run_id, name)
      )`,
    ],
  },
  {
    version: 10,
    name: "native runs' progress (ADR 64)",
    statements: [
      // What a forward or forward_backward measured, kept past the release of its result: the
      // console draws a run's loss from these.
      "ALTER TABLE training_operations ADD COLUMN loss DOUBLE PRECISION",
      "ALTER TABLE training_operations ADD COLUMN tokens BIGINT",
      "CREATE INDEX training_runs_entity ON training_runs (entity, id)",
    ],
  },
  {
    version: 11,
    name: "OpenAI's files and fine-tuning jobs (ADR 70)",
    statements: [
      // A file is a dataset; the name it was uploaded under is kept for OpenAI's `filename`.
      "ALTER TABLE datasets ADD COLUMN filename TEXT",
      // A paused job stays `queued` (so the status CHECK and the queue's index stand) but is
      // never claimed until it is resumed.
      "ALTER TABLE training_jobs ADD COLUMN paused_at BIGINT",
      `CREATE TABLE fine_tuning_jobs (
        id TEXT PRIMARY KEY,
        job_id TEXT NOT NULL UNIQUE REFERENCES training_jobs(id) ON DELETE CASCADE,
        entity TEXT NOT NULL REFERENCES entities(name),
        fine_tuned_model TEXT NOT NULL UNIQUE,
        base_model TEXT NOT NULL,
        training_file TEXT NOT NULL,
        validation_file TEXT,
        suffix TEXT,
        seed BIGINT NOT NULL,
        method TEXT NOT NULL,
        hyperparameters TEXT NOT NULL,
        metadata TEXT,
        trained_tokens BIGINT,
        created_at BIGINT NOT NULL
      )`,
      "CREATE INDEX fine_tuning_jobs_entity ON fine_tuning_jobs (entity, id)",
    ],
  },
];

/**
 * Applies the missing migrations in one transaction. On PostgreSQL an advisory transaction lock
 * (keyed by the schema) makes concurrent starters wait for the first one instead of racing.
 * Returns the versions applied now.
 */
export async function migrate(
  sql: Sql,
  migrations: readonly Migration[] = MIGRATIONS,
): Promise<number[]> {
  return sql.transaction(async (tx) => {
    if (tx.dialect === "postgres") {
      await tx.query("SELECT pg_advisory_xact_lock(726201, hashtext(current_schema()))");
    }
    await tx.exec(
      `CREATE TABLE IF NOT EXISTS schema_migrations (
        version INTEGER PRIMARY KEY,
        name TEXT NOT NULL,
        applied_at BIGINT NOT NULL
      )`,
    );
    const rows = await tx.query("SELECT version FROM schema_migrations");
    const applied = new Set(rows.map((r) => num(r.version)));
    const done: number[] = [];
    for (const m of [...migrations].sort((a, b) => a.version - b.version)) {
      if (applied.has(m.version)) continue;
      for (const statement of m.statements) {
        const text = typeof statement === "string" ? statement : statement[tx.dialect];
        if (text !== undefined) await tx.exec(text);
      }
      await m.run?.(tx);
      await tx.exec(
        "INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)",
        [m.version, m.name, Math.floor(Date.now() / 1000)],
      );
      done.push(m.version);
    }
    return done;
  });
}

/** An ended call's summary, as version 5 reads it (parsed where a bad one can be passed over). */
const ENDED_CALLS = rowSchema({ project_id: str, id: str, summary: strOrNull });

/** Version 5's data: every ended call's usage rows from its summary, a chunk at a time; the
 * links of every visible call, from the roots down; then `call_usage`. */
async function backfillUsageAndLinks(tx: Sql): Promise<void> {
  let after: [string, string] | undefined;
  for (;;) {
    const rows = (
      await tx.query(
        `SELECT ${ENDED_CALLS.columns()} FROM calls WHERE ended_at IS NOT NULL
         ${after ? "AND (project_id > $1 OR (project_id = $1 AND id > $2))" : ""}
         ORDER BY project_id, id LIMIT 1000`,
        after ?? [],
      )
    ).map(ENDED_CALLS.read);
    if (rows.length === 0) break;
    const last = rows[rows.length - 1]!;
    after = [last.project_id, last.id];
    const byProject = new Map<string, [string, string][]>();
    for (const r of rows) {
      let summary: unknown = null;
      try {
        summary = json(r.summary);
      } catch {
        // Stored as JSON text by this store; anything else has no usage to count.
      }
      const usage = usageRowsJson(usageRowsOf(summary));
      if (usage === null) continue;
      const list = byProject.get(r.project_id) ?? [];
      list.push([r.id, usage]);
      byProject.set(r.project_id, list);
    }
    for (const [project, list] of byProject) {
      const ids = listParam(list.map(([id]) => id));
      const values = JSON.stringify(list);
      await tx.exec(
        tx.dialect === "sqlite"
          ? `UPDATE calls SET usage_rows = (SELECT json_extract(v.value, '$[1]') FROM json_each($3) v
               WHERE json_extract(v.value, '$[0]') = calls.id)
             WHERE project_id = $1 AND ${inList(tx.dialect, "id", 2)}`
          : `UPDATE calls SET usage_rows = v.value ->> 1
             FROM jsonb_array_elements($3::jsonb) v
             WHERE calls.project_id = $1 AND calls.id = v.value ->> 0 AND ${inList(tx.dialect, "calls.id", 2)}`,
        [project, ids, values],
      );
    }
  }
  await tx.exec(
    "UPDATE calls SET link = 2 WHERE parent_id IS NULL AND started = 1 AND deleted_at IS NULL",
  );
  await tx.exec(
    `WITH RECURSIVE linked(project_id, id, trace_id) AS (
       SELECT project_id, id, trace_id FROM calls WHERE link = 2
       UNION ALL
       SELECT c.project_id, c.id, c.trace_id FROM linked l CROSS JOIN calls c
       WHERE c.project_id = l.project_id AND c.parent_id = l.id AND c.trace_id = l.trace_id
         AND c.parent_id IS NOT NULL AND c.started = 1 AND c.deleted_at IS NULL
     )
     UPDATE calls SET link = 1
     WHERE parent_id IS NOT NULL AND (project_id, id) IN (SELECT project_id, id FROM linked)`,
  );
  await tx.exec(insertUsageRows(tx.dialect, "1 = 1"));
}

/** Version 6's data: the step of each job's first report of a step, in sequence order. A
 * repeat written before the key existed keeps a null step: it stays, as events are immutable,
 * but no longer counts as the step's report. */
/** Sets `step` on the events a JSON array of `[job_id, sequence, step]` names. */
const SET_EVENT_STEPS = {
  sqlite: `UPDATE job_events SET step = v.step
    FROM (SELECT json_extract(value, '$[0]') AS job_id, json_extract(value, '$[1]') AS sequence,
                 json_extract(value, '$[2]') AS step FROM json_each($1)) AS v
    WHERE job_events.job_id = v.job_id AND job_events.sequence = v.sequence`,
  postgres: `UPDATE job_events AS e SET step = v.step
    FROM (SELECT x->>0 AS job_id, (x->>1)::bigint AS sequence, (x->>2)::integer AS step
          FROM jsonb_array_elements($1::jsonb) AS x) AS v
    WHERE e.job_id = v.job_id AND e.sequence = v.sequence`,
} as const;

/** An event that may report a step, as version 6 reads it. */
const STEP_EVENTS = rowSchema({ job_id: str, sequence: num, type: str, data: json<Json> });

async function backfillEventSteps(tx: Sql): Promise<void> {
  let after: [string, number] = ["", 0];
  let job = "";
  let seen = new Set<string>();
  for (;;) {
    const rows = (
      await tx.query(
        `SELECT ${STEP_EVENTS.columns()} FROM job_events
         WHERE type IN ('gradient_step', 'checkpoint_saved')
           AND (job_id > $1 OR (job_id = $1 AND sequence > $2))
         ORDER BY job_id, sequence LIMIT 1000`,
        after,
      )
    ).map(STEP_EVENTS.read);
    if (rows.length === 0) return;
    const keyed: [string, number, number][] = [];
    for (const r of rows) {
      if (r.job_id !== job) {
        job = r.job_id;
        seen = new Set();
      }
      const step = eventStep(r.type, r.data);
      if (step === null || seen.has(`${r.type} ${step}`)) continue;
      seen.add(`${r.type} ${step}`);
      keyed.push([r.job_id, r.sequence, step]);
    }
    // One statement per page of events, not a round trip per event.
    if (keyed.length > 0) await tx.exec(SET_EVENT_STEPS[tx.dialect], [JSON.stringify(keyed)]);
    const last = rows.at(-1)!;
    after = [last.job_id, last.sequence];
  }
}
