import type { Sql } from "./sql.ts";

export interface Migration {
  version: number;
  name: string;
  /** Portable DDL: both SQLite and PostgreSQL accept every statement below. */
  statements: readonly string[];
}

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
    const rows = await tx.query<{ version: number }>("SELECT version FROM schema_migrations");
    const applied = new Set(rows.map((r) => Number(r.version)));
    const done: number[] = [];
    for (const m of [...migrations].sort((a, b) => a.version - b.version)) {
      if (applied.has(m.version)) continue;
      for (const statement of m.statements) await tx.exec(statement);
      await tx.exec(
        "INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)",
        [m.version, m.name, Math.floor(Date.now() / 1000)],
      );
      done.push(m.version);
    }
    return done;
  });
}
