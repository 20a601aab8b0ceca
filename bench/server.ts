import { readConfig } from "@arbor/config";
import { type AppConfig, type ArborServer, buildServer } from "@arbor/server";
import { pino } from "pino";

/**
 * The real server for a bench, built as `serve()` builds it (`buildServer`) on 127.0.0.1 port 0,
 * over `dataDir` (SQLite) or a PostgreSQL schema; errors only are logged, to stderr (a bench's
 * stdout is its channel to the parent). Resolves once it listens.
 */
export async function startBenchServer(options: {
  dataDir: string;
  databaseUrl?: string | undefined;
  schema?: string | undefined;
  worker?: boolean;
  app?: Partial<AppConfig>;
  /** More settings, as environment variables (e.g. ARBOR_ENGINE_THREADS). */
  env?: Record<string, string>;
}): Promise<ArborServer & { port: number; apiKey: string }> {
  const server = await buildServer(
    readConfig({
      ARBOR_DATA_DIR: options.dataDir,
      ARBOR_PORT: "0",
      ARBOR_EMBEDDED_WORKER: options.worker ? "on" : "off",
      ARBOR_WORKER_LEASE_MS: "60000",
      ...(options.databaseUrl
        ? { DATABASE_URL: options.databaseUrl, ARBOR_DATABASE_SCHEMA: options.schema }
        : {}),
      ...options.env,
    }),
    {
      logger: pino({ level: "error" }, pino.destination(2)),
      ...(options.app ? { app: options.app } : {}),
    },
  );
  await server.start();
  if (!server.firstStart) throw new Error("a fresh store has no users, so it must make an admin");
  return Object.assign(server, {
    port: Number(new URL(server.url!).port),
    apiKey: server.firstStart.token,
  });
}
