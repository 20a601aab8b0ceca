import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import pg from "pg";
import { afterAll, beforeAll, describe } from "vitest";
import { openStore, RedisRateLimits, type Store, type StoreOptions } from "../src/index.ts";

export const PG_URL = process.env.ARBOR_TEST_PG ?? "postgres://postgres@127.0.0.1:5432/test";

async function probePostgres(): Promise<string | null> {
  if (process.env.ARBOR_TEST_PG === "off") return "ARBOR_TEST_PG=off";
  const client = new pg.Client({ connectionString: PG_URL, connectionTimeoutMillis: 10_000 });
  try {
    await client.connect();
    await client.query("SELECT 1");
    return null;
  } catch (err) {
    return err instanceof Error ? err.message : String(err);
  } finally {
    await client.end().catch(() => {});
  }
}

/** Why the Postgres half is skipped, or null when it runs. Under `CI=true` an unreachable
 * PostgreSQL fails the run instead: CI machines have one. */
export const pgSkipReason = await probePostgres();
if (pgSkipReason !== null && pgSkipReason !== "ARBOR_TEST_PG=off" && process.env.CI === "true") {
  throw new Error(
    `[@arbor/store] PostgreSQL at ${PG_URL} is unreachable (${pgSkipReason}); CI needs it.`,
  );
}
if (pgSkipReason !== null) {
  console.log(
    pgSkipReason === "ARBOR_TEST_PG=off"
      ? "[@arbor/store] Postgres half SKIPPED: ARBOR_TEST_PG=off."
      : `[@arbor/store] Postgres half SKIPPED: cannot use ${PG_URL} (${pgSkipReason}). Set ARBOR_TEST_PG to a reachable URL to run it.`,
  );
}

export const REDIS_URL = process.env.ARBOR_TEST_REDIS ?? "redis://127.0.0.1:6379";

async function probeRedis(): Promise<string | null> {
  if (process.env.ARBOR_TEST_REDIS === "off") return "ARBOR_TEST_REDIS=off";
  try {
    const state = await RedisRateLimits.connect(REDIS_URL);
    await state.ping();
    await state.close();
    return null;
  } catch (err) {
    return err instanceof Error ? err.message : String(err);
  }
}

/** Why the Redis half is skipped, or null when it runs; like PostgreSQL, an error under
 * `CI=true`. */
export const redisSkipReason = await probeRedis();
if (
  redisSkipReason !== null &&
  redisSkipReason !== "ARBOR_TEST_REDIS=off" &&
  process.env.CI === "true"
) {
  throw new Error(
    `[@arbor/store] Redis at ${REDIS_URL} is unreachable (${redisSkipReason}); CI needs it.`,
  );
}
if (redisSkipReason !== null) {
  console.log(
    redisSkipReason === "ARBOR_TEST_REDIS=off"
      ? "[@arbor/store] Redis half SKIPPED: ARBOR_TEST_REDIS=off."
      : `[@arbor/store] Redis half SKIPPED: ${redisSkipReason}. Set ARBOR_TEST_REDIS to a reachable URL to run it.`,
  );
}

export type BackendName = "sqlite" | "postgres";
export const BACKENDS: readonly BackendName[] = ["sqlite", "postgres"];

/** One backend's store for a test file: a temp dir (SQLite) or a fresh schema (Postgres). */
export class StoreContext {
  readonly backend: BackendName;
  /** The injected clock; tests move it instead of sleeping. */
  time = Date.now();
  readonly now = () => this.time;
  dataDir = "";
  schema = "";
  #store: Store | undefined;
  readonly #extra: Store[] = [];

  constructor(backend: BackendName) {
    this.backend = backend;
  }

  get store(): Store {
    if (!this.#store) throw new Error("store not open");
    return this.#store;
  }

  options(extra: Partial<StoreOptions> = {}): StoreOptions {
    return this.backend === "sqlite"
      ? { dataDir: this.dataDir, now: this.now, ...extra }
      : {
          databaseUrl: PG_URL,
          schema: this.schema,
          blobDir: join(this.dataDir, "blobs"),
          now: this.now,
          ...extra,
        };
  }

  async setup(): Promise<void> {
    this.dataDir = mkdtempSync(join(tmpdir(), "arbor-store-"));
    this.schema = `arbor_test_${randomBytes(6).toString("hex")}`;
    this.#store = await openStore(this.options());
  }

  /** Another handle on the same database (a second process's view, for concurrency tests). */
  async openAnother(extra: Partial<StoreOptions> = {}): Promise<Store> {
    const store = await openStore(this.options(extra));
    this.#extra.push(store);
    return store;
  }

  async teardown(): Promise<void> {
    for (const s of this.#extra) await s.close().catch(() => {});
    await this.#store?.close();
    if (this.backend === "postgres") {
      const client = new pg.Client({ connectionString: PG_URL });
      await client.connect();
      await client.query(`DROP SCHEMA IF EXISTS ${this.schema} CASCADE`);
      await client.end();
    }
    rmSync(this.dataDir, { recursive: true, force: true });
  }
}

/** Runs `body` once per backend, each with its own fresh store; Postgres is skipped loudly. */
export function describeBackends(title: string, body: (ctx: StoreContext) => void): void {
  for (const backend of BACKENDS) {
    describe.skipIf(backend === "postgres" && pgSkipReason !== null)(
      `${title} [${backend}]`,
      () => {
        const ctx = new StoreContext(backend);
        beforeAll(() => ctx.setup());
        afterAll(() => ctx.teardown());
        body(ctx);
      },
    );
  }
}

let counter = 0;
/** A name unique within the run, so tests in one file never collide. */
export function unique(prefix: string): string {
  counter++;
  return `${prefix}-${counter}-${randomBytes(3).toString("hex")}`;
}
