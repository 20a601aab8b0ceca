import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type ArborClient, type ArborClientOptions, createArborClient } from "@arbor/client";
import { readConfig } from "@arbor/config";
import { type AppConfig, buildServer, type EngineHost, type LlamaCppBackend } from "@arbor/server";
import type { RateLimitState, Store } from "@arbor/store";
import pg from "pg";
import { pino } from "pino";

export interface RunningServer {
  baseUrl: string;
  /** The server's data directory (its base models are under `models/`). */
  dataDir: string;
  store: Store;
  engines: EngineHost;
  /** Where its rate limits are counted. */
  rateLimits: RateLimitState;
  /** The operations this server answers 501 for. */
  pending: string[];
  /** The jobs its embedded worker runs now (none without one). */
  runningJobs(): string[];
  /** A client without a key; `maxRetries: 0` so a test sees each answer as sent. */
  client(options?: Partial<ArborClientOptions>): ArborClient;
  /** The first admin's key (user `admin`, entity `default`). */
  adminKey: string;
  /** A client with the first admin's key. */
  authorizedClient(options?: Partial<ArborClientOptions>): ArborClient;
  /** A new user in a new entity, and a client with its key. */
  newTenant(name: string): Promise<{ entity: string; apiKey: string; client: ArborClient }>;
  close(): Promise<void>;
}

/**
 * The real server, built as `serve()` builds it (`buildServer`), on port 0 with real
 * dependencies: a SQLite store in a temp dir (or a fresh PostgreSQL schema), the engine, and
 * the embedded training worker when asked for.
 */
export async function startServer(
  config: Partial<AppConfig> = {},
  options: {
    worker?: boolean;
    llama?: Map<string, LlamaCppBackend>;
    /** What the app sees of the store (a test double over the real one, say). */
    storeSeenByApp?: (store: Store) => Store;
    /** Run on PostgreSQL (a fresh schema, dropped on close) instead of SQLite. */
    postgres?: { url: string };
    /** More settings, as environment variables (`ARBOR_REDIS_URL`, say). */
    env?: Record<string, string>;
  } = {},
): Promise<RunningServer> {
  const dataDir = mkdtempSync(join(tmpdir(), "arbor-contract-"));
  const schema = options.postgres ? `arbor_contract_${randomBytes(6).toString("hex")}` : undefined;
  // ARBOR_TEST_LOG_LEVEL=error shows what the server logs (a 500's cause) while debugging.
  const level = process.env.ARBOR_TEST_LOG_LEVEL ?? "silent";
  const server = await buildServer(
    readConfig({
      ARBOR_DATA_DIR: dataDir,
      ARBOR_PORT: "0",
      ARBOR_LOG_LEVEL: level,
      ARBOR_EMBEDDED_WORKER: options.worker ? "on" : "off",
      ARBOR_WORKER_LEASE_MS: "60000",
      ARBOR_TRAINING_DATA_MAX_BYTES: String(1 << 20),
      ...(options.postgres
        ? { DATABASE_URL: options.postgres.url, ARBOR_DATABASE_SCHEMA: schema }
        : {}),
      ...options.env,
    }),
    {
      logger: pino({ level }),
      app: config,
      ...(options.storeSeenByApp ? { storeSeenByApp: options.storeSeenByApp } : {}),
      ...(options.llama ? { llama: options.llama } : {}),
    },
  );
  await server.start();
  const admin = server.firstStart!;
  const baseUrl = server.url!;
  const client = (options: Partial<ArborClientOptions> = {}) =>
    createArborClient({ baseUrl, maxRetries: 0, ...options });
  return {
    baseUrl,
    dataDir,
    store: server.store,
    engines: server.engines,
    rateLimits: server.rateLimits,
    pending: server.app.locals.pendingOperations as string[],
    runningJobs: () => server.worker?.running() ?? [],
    adminKey: admin.token,
    client,
    authorizedClient: (options = {}) => client({ apiKey: admin.token, ...options }),
    async newTenant(name) {
      const user = await server.store.users.create({ name, defaultEntity: name });
      const { token } = await server.store.apiKeys.create(user.id);
      return { entity: name, apiKey: token, client: client({ apiKey: token }) };
    },
    close: async () => {
      await server.close();
      if (schema && options.postgres) {
        const admin = new pg.Client({ connectionString: options.postgres.url });
        await admin.connect();
        await admin.query(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
        await admin.end();
      }
      rmSync(dataDir, { recursive: true, force: true });
    },
  };
}
