import type { Server } from "node:http";
import { openStore } from "@arbor/store";
import { EmbeddedWorker, sweepBlobs } from "@arbor/worker";
import { pino } from "pino";
import { createApp } from "./app.ts";
import { ensureFirstAdmin } from "./bootstrap.ts";
import { configFromEnv, type ServerConfig } from "./config.ts";
import { listen } from "./http/listen.ts";
import { loadSpec } from "./http/openapi.ts";
import { engineProbe, storeProbes, workerProbe } from "./modules/health/probes.ts";
import { EngineHost } from "./modules/inference/engines.ts";
import { LlamaCppBackend, parseLlamaModels } from "./modules/inference/llama-cpp.ts";

/** Builds the dependencies from `config` (the environment by default), listens, and shuts down
 * gracefully on SIGINT/SIGTERM. */
export async function serve(config: ServerConfig = configFromEnv()): Promise<void> {
  const logger = pino({ level: config.logLevel });
  const store = await openStore({
    dataDir: config.dataDir,
    databaseUrl: config.databaseUrl,
    ...(config.databaseSchema ? { schema: config.databaseSchema } : {}),
  });

  const first = await ensureFirstAdmin(store, config.dataDir);
  if (first) {
    // Printed once: only its hash is stored. The same key is in the file, readable by this user only.
    process.stderr.write(
      `\nFirst start: created user "admin" in entity "default" with this API key (shown once):\n\n  ${first.token}\n\nIt is also in ${first.keyPath} (mode 0600). Use it as:\n  curl -H "Authorization: Bearer $(cat ${first.keyPath})" http://${config.host}:${config.port}/v1/models\n\n`,
    );
  }

  const llama = new Map(
    [...parseLlamaModels(process.env)].map(([id, path]) => [id, new LlamaCppBackend(path)]),
  );
  const engines = new EngineHost({ llama, threads: config.engineThreads });
  // What a crash cut off (partial files, files whose row was never written) goes now and hourly.
  const sweep = () =>
    sweepBlobs(store).then(
      (swept) => {
        const count = Object.values(swept).reduce((n, keys) => n + keys.length, 0);
        if (count > 0) logger.info({ swept }, `removed ${count} unnamed or partial files`);
      },
      (err: unknown) => logger.warn({ err }, "could not sweep unnamed files"),
    );
  await sweep();
  setInterval(sweep, 60 * 60_000).unref();
  // Started once the port is ours: a second server on a taken port never touches the jobs.
  let worker: EmbeddedWorker | undefined;
  const notStarted = { success: false, error: "starting", threads: 0, running: 0 };
  const probes = storeProbes(store, engineProbe(engines));
  if (config.embeddedWorker) probes.worker = workerProbe(() => worker?.health() ?? notStarted);

  const app = createApp({
    config,
    logger,
    spec: loadSpec(),
    store,
    engines,
    probes,
    onJobQueued: () => worker?.poke(),
  });

  let server: Server;
  try {
    server = await listen(app, config.port, config.host);
  } catch (err) {
    const reason =
      (err as NodeJS.ErrnoException).code === "EADDRINUSE"
        ? `${config.host}:${config.port} is already in use (set ARBOR_PORT to another port)`
        : err instanceof Error
          ? err.message
          : String(err);
    logger.fatal({ err }, `Arbor cannot listen: ${reason}`);
    process.stderr.write(`arbor: cannot listen: ${reason}\n`);
    await worker?.stop().catch(() => {});
    await engines.dispose().catch(() => {});
    await store.close().catch(() => {});
    process.exit(1);
  }
  // Training runs on its own threads, so a step never stalls a request.
  if (config.embeddedWorker) {
    worker = await EmbeddedWorker.start({
      store,
      logger,
      threads: config.trainingThreads,
      dataDir: config.dataDir,
      databaseUrl: config.databaseUrl,
      schema: config.databaseSchema,
      logLevel: config.logLevel,
      leaseMs: config.workerLeaseMs,
      maxTrainingDataBytes: config.maxTrainingDataBytes,
      allowHosts: config.trainingDataAllowHosts,
    });
  }
  const address = server.address();
  const port = typeof address === "object" && address ? address.port : config.port;
  logger.info(
    {
      port,
      dataDir: config.dataDir,
      database: store.dialect,
      engineThreads: config.engineThreads,
      trainingThreads: config.embeddedWorker ? config.trainingThreads : 0,
    },
    `Arbor listening on http://${config.host}:${port} (docs at /docs)`,
  );

  function shutdown(signal: string) {
    logger.info({ signal }, "shutting down");
    server.close(() => {
      // A running job goes back to the queue, to resume from its last checkpoint.
      (worker?.stop() ?? Promise.resolve())
        .then(() => engines.dispose())
        .then(() => store.close())
        .finally(() => process.exit(0));
    });
    setTimeout(() => process.exit(1), 10_000).unref();
  }
  process.on("SIGINT", () => shutdown("SIGINT"));
  process.on("SIGTERM", () => shutdown("SIGTERM"));
}
