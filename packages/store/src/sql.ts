import { resolve } from "node:path";
import { DatabaseSync, type StatementSync } from "node:sqlite";
import pg from "pg";
import { InvalidInputError } from "./errors.ts";
import { str } from "./rows.ts";

export type Dialect = "sqlite" | "postgres";
export type SqlValue = string | number | bigint | boolean | null | undefined | Uint8Array;
export type Row = Record<string, unknown>;

export interface TransactionOptions {
  readOnly?: boolean;
}

/**
 * The one thin layer both backends share. SQL is written once with `$1`-style placeholders
 * (translated to `?1` for SQLite); where the dialects differ, callers branch on `dialect`.
 */
export interface Sql {
  readonly dialect: Dialect;
  query<T = Row>(text: string, params?: readonly SqlValue[]): Promise<T[]>;
  one<T = Row>(text: string, params?: readonly SqlValue[]): Promise<T | undefined>;
  /** Runs a statement and returns the number of rows it changed. */
  exec(text: string, params?: readonly SqlValue[]): Promise<number>;
  /** Runs `fn` in one transaction (SQLite: BEGIN IMMEDIATE, serialised); nested calls join it.
   * `readOnly`: one snapshot for every read in it, and no write lock (SQLite: a deferred BEGIN;
   * PostgreSQL: REPEATABLE READ, READ ONLY). */
  transaction<T>(fn: (tx: Sql) => Promise<T>, options?: TransactionOptions): Promise<T>;
  close(): Promise<void>;
}

/**
 * `column IN (…)` over a JSON array bound as one parameter, so id lists never hit parameter
 * limits. On PostgreSQL `= ANY(ARRAY(…))` keeps the primary-key index (a plain IN-subquery over
 * jsonb was planned as a scan of the whole project).
 */
export function inList(
  dialect: Dialect,
  column: string,
  param: number,
  type: "text" | "integer" = "text",
): string {
  if (dialect === "sqlite") return `${column} IN (SELECT value FROM json_each($${param}))`;
  const values = `jsonb_array_elements_text($${param}::jsonb)`;
  return `${column} = ANY(ARRAY(SELECT ${type === "integer" ? `CAST(v AS INTEGER) FROM ${values} v` : values}))`;
}

/** The values for `inList`, as its one JSON parameter; a string with NUL is refused as in any
 * other bound string. */
export function listParam(values: readonly (string | number)[]): string {
  for (const v of values) if (typeof v === "string") refuseNul(v);
  return JSON.stringify(values);
}

/**
 * Which of `values` a query finds: `query` selects one column named `value` and takes the list
 * as `$1` (for `inList`). Chunked, so any number of values can be asked about.
 */
export async function presentAmong(
  sql: Sql,
  query: string,
  values: readonly string[],
): Promise<Set<string>> {
  const found = new Set<string>();
  for (let i = 0; i < values.length; i += 5000) {
    const rows = await sql.query(query, [listParam(values.slice(i, i + 5000))]);
    for (const row of rows) found.add(str(row.value));
  }
  return found;
}

const PLACEHOLDER = /\$(\d+)/g;

/**
 * PostgreSQL cannot store a NUL character in text, nor read a lone UTF-16 surrogate in JSON;
 * SQLite can do both. Every bound string is refused on both when it holds either, so one store
 * never keeps what the other would refuse. (Free-form JSON is stored as text and never reaches
 * this check.)
 */
function refuseNul(value: string): string {
  if (value.includes("\u0000")) {
    throw new InvalidInputError("A string value contains a NUL character (U+0000).", {
      code: "invalid_value",
    });
  }
  if (!value.isWellFormed()) {
    throw new InvalidInputError("A string value contains a lone UTF-16 surrogate.", {
      code: "invalid_value",
    });
  }
  return value;
}

function sqliteParams(
  params: readonly SqlValue[] | undefined,
): (string | number | bigint | null | Uint8Array)[] {
  if (!params) return [];
  return params.map((v) =>
    v === undefined
      ? null
      : typeof v === "boolean"
        ? v
          ? 1
          : 0
        : typeof v === "string"
          ? refuseNul(v)
          : v,
  );
}

export interface SqliteOptions {
  /** A file path, or ":memory:". */
  path: string;
  busyTimeoutMs?: number;
}

class SqliteTx implements Sql {
  readonly dialect = "sqlite" as const;
  readonly #owner: SqliteSql;
  constructor(owner: SqliteSql) {
    this.#owner = owner;
  }
  async query<T = Row>(text: string, params?: readonly SqlValue[]): Promise<T[]> {
    return this.#owner.allNow(text, params) as T[];
  }
  async one<T = Row>(text: string, params?: readonly SqlValue[]): Promise<T | undefined> {
    return this.#owner.allNow(text, params)[0] as T | undefined;
  }
  async exec(text: string, params?: readonly SqlValue[]): Promise<number> {
    return this.#owner.runNow(text, params);
  }
  transaction<T>(fn: (tx: Sql) => Promise<T>): Promise<T> {
    return fn(this);
  }
  async close(): Promise<void> {
    throw new Error("close() inside a transaction");
  }
}

interface Prepared {
  stmt: StatementSync;
  /** Which given value binds each `?`; null when they are simply $1, $2, … in order. */
  order: number[] | null;
}

interface Gate {
  active: Promise<void> | null;
  users: number;
}

/**
 * One gate per database file in this process. Two connections to one file in one process must
 * not wait on each other through busy_timeout: that wait is synchronous, blocks the event loop,
 * and so the holder could never finish. They queue on this gate instead; busy_timeout is left for
 * other processes.
 */
const gates = new Map<string, Gate>();

/**
 * node:sqlite's DatabaseSync is synchronous and has one connection, so an open transaction that
 * awaits would otherwise let unrelated statements run inside it. Every statement therefore waits
 * while a transaction is active, and transactions run one at a time.
 */
export class SqliteSql implements Sql {
  readonly dialect = "sqlite" as const;
  readonly db: DatabaseSync;
  readonly #statements = new Map<string, Prepared>();
  readonly #gate: Gate;
  readonly #gateKey: string | null;
  readonly #tx = new SqliteTx(this);

  constructor(options: SqliteOptions) {
    this.db = new DatabaseSync(options.path);
    this.db.exec(`PRAGMA busy_timeout = ${Math.floor(options.busyTimeoutMs ?? 5000)}`);
    if (options.path !== ":memory:") {
      this.db.exec("PRAGMA journal_mode = WAL");
      // WAL + NORMAL survives a killed process with every committed transaction intact;
      // only an OS crash may lose the last few commits (never corrupt the file).
      this.db.exec("PRAGMA synchronous = NORMAL");
    }
    this.db.exec("PRAGMA foreign_keys = ON");
    this.#gateKey = options.path === ":memory:" ? null : resolve(options.path);
    let gate = this.#gateKey ? gates.get(this.#gateKey) : undefined;
    if (!gate) {
      gate = { active: null, users: 0 };
      if (this.#gateKey) gates.set(this.#gateKey, gate);
    }
    gate.users++;
    this.#gate = gate;
  }

  /**
   * `$n` placeholders become anonymous `?` plus an index map that reorders (and repeats) the
   * values at bind time: node:sqlite binds numbered `?NNN` parameters far more slowly (a 400-row
   * insert took 460 ms with `?NNN`, 10 ms with `?`).
   */
  #prepare(text: string): Prepared {
    let prepared = this.#statements.get(text);
    if (!prepared) {
      const order: number[] = [];
      const translated = text.replace(PLACEHOLDER, (_, n: string) => {
        order.push(Number(n) - 1);
        return "?";
      });
      const identity = order.every((v, i) => v === i);
      prepared = { stmt: this.db.prepare(translated), order: identity ? null : order };
      if (this.#statements.size > 500) this.#statements.clear();
      this.#statements.set(text, prepared);
    }
    return prepared;
  }

  #bind(prepared: Prepared, params: readonly SqlValue[] | undefined) {
    const values = sqliteParams(params);
    return prepared.order ? prepared.order.map((i) => values[i] ?? null) : values;
  }

  allNow(text: string, params?: readonly SqlValue[]): Row[] {
    const prepared = this.#prepare(text);
    return prepared.stmt.all(...this.#bind(prepared, params)) as Row[];
  }

  runNow(text: string, params?: readonly SqlValue[]): number {
    const prepared = this.#prepare(text);
    return Number(prepared.stmt.run(...this.#bind(prepared, params)).changes);
  }

  // Each caller re-checks the gate synchronously right before running: no await between the
  // check and the statement (or the BEGIN), so nothing can slip in.

  async query<T = Row>(text: string, params?: readonly SqlValue[]): Promise<T[]> {
    while (this.#gate.active) await this.#gate.active;
    return this.allNow(text, params) as T[];
  }

  async one<T = Row>(text: string, params?: readonly SqlValue[]): Promise<T | undefined> {
    while (this.#gate.active) await this.#gate.active;
    return this.allNow(text, params)[0] as T | undefined;
  }

  async exec(text: string, params?: readonly SqlValue[]): Promise<number> {
    while (this.#gate.active) await this.#gate.active;
    return this.runNow(text, params);
  }

  async transaction<T>(fn: (tx: Sql) => Promise<T>, options?: TransactionOptions): Promise<T> {
    while (this.#gate.active) await this.#gate.active;
    let release: () => void = () => {};
    this.#gate.active = new Promise<void>((resolve) => {
      release = resolve;
    });
    try {
      // WAL: a deferred transaction reads one snapshot from its first read on and lets other
      // processes write meanwhile.
      this.db.exec(options?.readOnly ? "BEGIN" : "BEGIN IMMEDIATE");
      try {
        const result = await fn(this.#tx);
        this.db.exec("COMMIT");
        return result;
      } catch (err) {
        if (this.db.isTransaction) this.db.exec("ROLLBACK");
        throw err;
      }
    } finally {
      this.#gate.active = null;
      release();
    }
  }

  async close(): Promise<void> {
    while (this.#gate.active) await this.#gate.active;
    this.#statements.clear();
    if (this.db.isOpen) {
      this.db.close();
      this.#gate.users--;
      if (this.#gateKey && this.#gate.users === 0) gates.delete(this.#gateKey);
    }
  }
}

const NUMERIC_TYPES = new Set<number>([pg.types.builtins.INT8, pg.types.builtins.NUMERIC]);

/** int8 and numeric come back as JS numbers: counts, sums and millisecond timestamps fit. */
const pgTypes = {
  getTypeParser(oid: number, format?: "text" | "binary") {
    if (NUMERIC_TYPES.has(oid) && format !== "binary") {
      return (value: string) => Number(value);
    }
    // biome-ignore lint/suspicious/noExplicitAny: pg's overloads cannot be expressed without it
    return (pg.types.getTypeParser as any)(oid, format);
  },
};

interface PgQueryable {
  query(text: string, params?: unknown[]): Promise<pg.QueryResult>;
}

function pgParams(params: readonly SqlValue[] | undefined): unknown[] {
  if (!params) return [];
  return params.map((v) =>
    v === undefined
      ? null
      : typeof v === "bigint"
        ? v.toString()
        : typeof v === "string"
          ? refuseNul(v)
          : v,
  );
}

class PgTx implements Sql {
  readonly dialect = "postgres" as const;
  readonly #client: PgQueryable;
  constructor(client: PgQueryable) {
    this.#client = client;
  }
  async query<T = Row>(text: string, params?: readonly SqlValue[]): Promise<T[]> {
    return (await this.#client.query(text, pgParams(params))).rows as T[];
  }
  async one<T = Row>(text: string, params?: readonly SqlValue[]): Promise<T | undefined> {
    return (await this.query<T>(text, params))[0];
  }
  async exec(text: string, params?: readonly SqlValue[]): Promise<number> {
    return (await this.#client.query(text, pgParams(params))).rowCount ?? 0;
  }
  transaction<T>(fn: (tx: Sql) => Promise<T>): Promise<T> {
    return fn(this);
  }
  async close(): Promise<void> {
    throw new Error("close() inside a transaction");
  }
}

export interface PostgresOptions {
  connectionString: string;
  /** Every connection uses this schema first (created on open when missing). */
  schema?: string;
  max?: number;
}

export const SCHEMA_NAME = /^[a-z_][a-z0-9_]{0,62}$/;

export class PostgresSql implements Sql {
  readonly dialect = "postgres" as const;
  readonly pool: pg.Pool;
  readonly #plain: PgTx;

  constructor(options: PostgresOptions) {
    if (options.schema !== undefined && !SCHEMA_NAME.test(options.schema)) {
      throw new Error(`Invalid schema name: ${options.schema}`);
    }
    this.pool = new pg.Pool({
      connectionString: options.connectionString,
      max: options.max ?? 10,
      types: pgTypes,
      ...(options.schema ? { options: `-c search_path=${options.schema}` } : {}),
    });
    // An idle client losing its connection must not crash the process; the pool replaces it.
    this.pool.on("error", () => {});
    this.#plain = new PgTx(this.pool);
  }

  query<T = Row>(text: string, params?: readonly SqlValue[]): Promise<T[]> {
    return this.#plain.query<T>(text, params);
  }
  one<T = Row>(text: string, params?: readonly SqlValue[]): Promise<T | undefined> {
    return this.#plain.one<T>(text, params);
  }
  exec(text: string, params?: readonly SqlValue[]): Promise<number> {
    return this.#plain.exec(text, params);
  }

  async transaction<T>(fn: (tx: Sql) => Promise<T>, options?: TransactionOptions): Promise<T> {
    const client = await this.pool.connect();
    let broken = false;
    try {
      await client.query(
        options?.readOnly ? "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY" : "BEGIN",
      );
      try {
        const result = await fn(new PgTx(client));
        await client.query("COMMIT");
        return result;
      } catch (err) {
        try {
          await client.query("ROLLBACK");
        } catch {
          broken = true;
        }
        throw err;
      }
    } finally {
      client.release(broken);
    }
  }

  async close(): Promise<void> {
    await this.pool.end();
  }
}
