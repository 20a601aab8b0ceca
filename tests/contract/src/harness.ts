import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type ArborClient, type ArborClientOptions, createArborClient } from "@arbor/client";
import {
  type AppConfig,
  createApp,
  defaultAppConfig,
  EngineHost,
  engineProbe,
  ensureFirstAdmin,
  type LlamaCppBackend,
  listen,
  loadSpec,
  storeProbes,
  workerProbe,
} from "@arbor/server";
import { openStore, type Store } from "@arbor/store";
import { EmbeddedWorker } from "@arbor/worker";
import { pino } from "pino";

export interface RunningServer {
  baseUrl: string;
  store: Store;
  engines: EngineHost;
  /** The operations this server answers 501 for. */
  pending: string[];
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

/** Starts the real app on port 0 with real dependencies: a SQLite store in a temp dir. */
export async function startServer(
  config: Partial<AppConfig> = {},
  options: {
    worker?: boolean;
    llama?: Map<string, LlamaCppBackend>;
    /** What the app sees of the store (a test double over the real one, say). */
    storeSeenByApp?: (store: Store) => Store;
    /** Run on PostgreSQL (a fresh schema, dropped on close) instead of SQLite. */
    postgres?: { url: string };
  } = {},
): Promise<RunningServer> {
  const dataDir = mkdtempSync(join(tmpdir(), "arbor-contract-"));
  const schema = options.postgres ? `arbor_contract_${randomBytes(6).toString("hex")}` : undefined;
  const store = await openStore(
    options.postgres
      ? { dataDir, databaseUrl: options.postgres.url, schema: schema! }
      : { dataDir },
  );
  const admin = await ensureFirstAdmin(store, dataDir);
  const spec = loadSpec();
  // The embedded worker as `serve()` runs it: on its own thread, over the same data dir.
  const worker = options.worker
    ? await EmbeddedWorker.start({
        store,
        logger: pino({ level: "silent" }),
        dataDir,
        databaseUrl: options.postgres?.url,
        schema,
        logLevel: "silent",
        leaseMs: 60_000,
        maxTrainingDataBytes: 1 << 20,
        allowHosts: [],
      })
    : undefined;
  const engines = new EngineHost({ ...(options.llama ? { llama: options.llama } : {}) });
  const probes = storeProbes(store, engineProbe(engines));
  if (worker) probes.worker = workerProbe(() => worker.health());
  const app = createApp({
    config: defaultAppConfig(config),
    // ARBOR_TEST_LOG_LEVEL=error shows what the server logs (a 500's cause) while debugging.
    logger: pino({ level: process.env.ARBOR_TEST_LOG_LEVEL ?? "silent" }),
    spec,
    store: options.storeSeenByApp?.(store) ?? store,
    engines,
    probes,
    onJobQueued: () => worker?.poke(),
  });
  const server = await listen(app, 0, "127.0.0.1");
  const { port } = server.address() as AddressInfo;
  const baseUrl = `http://127.0.0.1:${port}`;
  const client = (options: Partial<ArborClientOptions> = {}) =>
    createArborClient({ baseUrl, maxRetries: 0, ...options });
  return {
    baseUrl,
    store,
    engines,
    pending: app.locals.pendingOperations as string[],
    adminKey: admin!.token,
    client,
    authorizedClient: (options = {}) => client({ apiKey: admin!.token, ...options }),
    async newTenant(name) {
      const user = await store.users.create({ name, defaultEntity: name });
      const { token } = await store.apiKeys.create(user.id);
      return { entity: name, apiKey: token, client: client({ apiKey: token }) };
    },
    close: async () => {
      await new Promise<void>((resolve, reject) => {
        server.closeAllConnections();
        server.close((err) => (err ? reject(err) : resolve()));
      });
      await worker?.stop();
      await engines.dispose();
      if (schema) await store.sql.exec(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
      await store.close();
      rmSync(dataDir, { recursive: true, force: true });
    },
  };
}
