import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { type BlobStore, FsBlobStore } from "./blobs.ts";
import { CallsRepo } from "./calls.ts";
import type { Clock } from "./common.ts";
import { DatasetsRepo } from "./datasets.ts";
import { isUniqueViolation } from "./errors.ts";
import { FineTuningJobsRepo } from "./fine-tuning.ts";
import { ApiKeysRepo, EntitiesRepo, UsersRepo } from "./identity.ts";
import { JobsRepo } from "./jobs.ts";
import { MemoryBlobStore } from "./memory-blobs.ts";
import { migrate } from "./migrations.ts";
import { ModelsRepo } from "./models.ts";
import { PgBlobStore } from "./pg-blobs.ts";
import { PricesRepo } from "./prices.ts";
import { type Dialect, PostgresSql, type Sql, SqliteSql } from "./sql.ts";
import { TrainingRunsRepo } from "./training-runs.ts";

export interface StoreOptions {
  /**
   * SQLite: the data directory holding `arbor.db` (and `blobs/`), or ":memory:" (then blobs are
   * kept in memory too, unless `blobDir` is given). Ignored for the database when `databaseUrl`
   * is set, but still the default home of `fs` blobs.
   */
  dataDir?: string;
  /** A postgres:// URL: use PostgreSQL instead of SQLite. */
  databaseUrl?: string;
  /** PostgreSQL only: the schema to use (created when missing). */
  schema?: string;
  /** Where checkpoint and dataset files live: `postgres` (the database's own tables, shared by
   * every replica; only with `databaseUrl`) or `fs` (a directory: `blobDir`, else
   * `<dataDir>/blobs`; with neither, an in-memory SQLite store keeps them in memory). Default:
   * `postgres` with `databaseUrl`, else `fs`. */
  blobs?: BlobBackend;
  /** `fs` blobs: where they go; default `<dataDir>/blobs`. */
  blobDir?: string;
  /** Injected clock (Unix ms), for leases and timestamps in tests. */
  now?: Clock;
  /** A job whose worker dies this many times (its lease expired, or its worker restarted) is
   * failed instead of requeued. Default 2. */
  maxJobCrashes?: number;
  /** PostgreSQL pool size. Default 10. */
  poolSize?: number;
}

export type BlobBackend = "fs" | "postgres";
export const BLOB_BACKENDS: readonly BlobBackend[] = ["fs", "postgres"];

export interface PingResult {
  success: boolean;
  /** Milliseconds. */
  duration: number;
  error: string | null;
}

export interface Store {
  readonly dialect: Dialect;
  readonly sql: Sql;
  readonly entities: EntitiesRepo;
  readonly users: UsersRepo;
  readonly apiKeys: ApiKeysRepo;
  readonly models: ModelsRepo;
  readonly jobs: JobsRepo;
  readonly datasets: DatasetsRepo;
  readonly fineTuningJobs: FineTuningJobsRepo;
  readonly calls: CallsRepo;
  readonly prices: PricesRepo;
  /** The native training API's runs, operations and saved states (ADR 57). */
  readonly trainingRuns: TrainingRunsRepo;
  /** Checkpoint and dataset files: in PostgreSQL, in a directory, or in memory beside an
   * in-memory SQLite database. */
  readonly blobs: BlobStore;
  /** The migration versions applied by this open. */
  readonly migrated: number[];
  ping(): Promise<PingResult>;
  close(): Promise<void>;
}

/**
 * Opens the store: PostgreSQL when `databaseUrl` is given, else SQLite in `dataDir`
 * (or in memory). Runs pending migrations before returning.
 */
export async function openStore(options: StoreOptions = {}): Promise<Store> {
  const now = options.now ?? Date.now;
  const blobBackend = options.blobs ?? (options.databaseUrl ? "postgres" : "fs");
  if (blobBackend === "postgres" && !options.databaseUrl) {
    throw new Error("Blobs in PostgreSQL need a databaseUrl (SQLite keeps them in a directory).");
  }
  const blobDir =
    options.blobDir ??
    (options.dataDir && options.dataDir !== ":memory:"
      ? join(options.dataDir, "blobs")
      : undefined);
  if (blobBackend === "fs" && !blobDir && options.databaseUrl) {
    throw new Error("Blobs in files (fs) on PostgreSQL need a dataDir or a blobDir.");
  }
  let sql: Sql;
  if (options.databaseUrl) {
    // The constructor refuses a schema name that is not a plain identifier.
    const pg = new PostgresSql({
      connectionString: options.databaseUrl,
      ...(options.schema ? { schema: options.schema } : {}),
      ...(options.poolSize ? { max: options.poolSize } : {}),
    });
    sql = pg;
    if (options.schema) {
      try {
        await pg.exec(`CREATE SCHEMA IF NOT EXISTS ${options.schema}`);
      } catch (err) {
        // Two openers racing on CREATE SCHEMA: the loser sees a duplicate; the schema exists.
        if (!isUniqueViolation(err)) {
          await pg.close();
          throw err;
        }
      }
    }
  } else {
    const dir = options.dataDir ?? ":memory:";
    let path = ":memory:";
    if (dir !== ":memory:") {
      mkdirSync(dir, { recursive: true });
      path = join(dir, "arbor.db");
    }
    sql = new SqliteSql({ path });
  }

  let migrated: number[];
  try {
    migrated = await migrate(sql);
  } catch (err) {
    await sql.close();
    throw err;
  }

  // SQLite in memory without a blobDir: blobs in memory too, gone with the store like its rows.
  const blobs: BlobStore =
    blobBackend === "postgres" && sql instanceof PostgresSql
      ? new PgBlobStore(sql, now)
      : blobDir
        ? new FsBlobStore(blobDir)
        : new MemoryBlobStore(now);

  return {
    dialect: sql.dialect,
    sql,
    entities: new EntitiesRepo(sql, now),
    users: new UsersRepo(sql, now),
    apiKeys: new ApiKeysRepo(sql, now),
    models: new ModelsRepo(sql, now),
    jobs: new JobsRepo(sql, now, options.maxJobCrashes ?? 2),
    datasets: new DatasetsRepo(sql, now),
    fineTuningJobs: new FineTuningJobsRepo(sql, now),
    calls: new CallsRepo(sql, now),
    prices: new PricesRepo(sql, now),
    trainingRuns: new TrainingRunsRepo(sql, now),
    blobs,
    migrated,
    async ping(): Promise<PingResult> {
      const started = performance.now();
      try {
        await sql.one("SELECT 1 AS ok");
        return { success: true, duration: performance.now() - started, error: null };
      } catch (err) {
        return {
          success: false,
          duration: performance.now() - started,
          error: err instanceof Error ? err.message : String(err),
        };
      }
    },
    close: () => sql.close(),
  };
}
