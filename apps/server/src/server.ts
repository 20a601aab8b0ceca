import type { Server } from "node:http";
import { baseModelsDir, type Config, storeOptionsOf, workerOptionsOf } from "@arbor/config";
import {
  checkFilesLeftInDataDir,
  openRateLimits,
  openStore,
  type RateLimitState,
  type Store,
} from "@arbor/store";
import { EmbeddedWorker, type SweepResult, sweepBlobs, sweepExports } from "@arbor/training";
import type { Express } from "express";
import { type Logger, pino } from "pino";
import { createApp } from "./app.ts";
import { ensureFirstAdmin, type FirstStart } from "./bootstrap.ts";
import { type AppConfig, appConfigOf } from "./config.ts";
import { listen } from "./http/listen.ts";
import { loadSpec } from "./http/openapi.ts";
import { engineProbe, redisProbe, storeProbes, workerProbe } from "./modules/health/probes.ts";
import { EngineHost } from "./modules/inference/engines.ts";
import { LlamaCppBackend } from "./modules/inference/llama-cpp.ts";
import { UpstreamAdapters } from "./modules/inference/upstream-lora.ts";
import { Metrics } from "./modules/metrics/metrics.ts";

/** What a caller may change of how the server is put together: tests and benches. */
export interface BuildOptions {
  logger?: Logger;
  /** Overrides of the app's configuration (validation off, limits, upstreams). */
  app?: Partial<AppConfig>;
  /** What the app sees of the store (a test double over the real one, say). */
  storeSeenByApp?: (store: Store) => Store;
  /** llama.cpp backends by model id, instead of those `config.llamaModels` names. */
  llama?: Map<string, LlamaCppBackend>;
}

/** The server, put together from its configuration: every dependency, and the app over them. */
export interface ArborServer {
  readonly config: Config;
  readonly logger: Logger;
  readonly app: Express;
  readonly store: Store;
  readonly engines: EngineHost;
  /** The first admin key, when this start created it (an empty store). */
  readonly firstStart: FirstStart | undefined;
  /** The embedded training worker, once `start()` ran it. */
  readonly worker: EmbeddedWorker | undefined;
  /** Where the rate limits are counted. */
  readonly rateLimits: RateLimitState;
  /** The listening HTTP server, once `start()` bound it. */
  readonly http: Server | undefined;
  /** Where it listens, once started: `http://host:port`. */
  readonly url: string | undefined;
  /** Binds the port (rejecting when it cannot), sweeps what a crash left, and only then starts
   * the embedded worker: a second server on a taken port never touches the jobs. */
  start(): Promise<void>;
  /** Stops taking requests, hands running jobs back to the queue, stops the engines, closes
   * the store. */
  close(): Promise<void>;
}

/**
 * The one composition root: `serve()`, the contract tests and the benches all build the server
 * here, from a `Config` (read by `readConfig`), so what runs in tests is what runs in production.
 */
export async function buildServer(
  config: Config,
  options: BuildOptions = {},
): Promise<ArborServer> {
  const logger = options.logger ?? pino({ level: config.logLevel });
  const store = await openStore(storeOptionsOf(config));
  const firstStart = await ensureFirstAdmin(store, config.dataDir);
  // Blobs moved into PostgreSQL by default: a data directory's files are never left unseen.
  const left = await checkFilesLeftInDataDir(
    store,
    config.dataDir,
    config.blobs !== undefined,
  ).catch(async (err: unknown) => {
    await store.close();
    throw err;
  });
  if (left) logger.warn({ dataDir: config.dataDir }, left);
  // Rate limits every replica shares: Redis with ARBOR_REDIS_URL, else PostgreSQL, else here.
  let rateLimits: RateLimitState;
  try {
    rateLimits = await openRateLimits({
      sql: store.sql,
      redisUrl: config.redisUrl,
      namespace: config.databaseSchema,
    });
  } catch (err) {
    await store.close();
    throw new Error(`${err instanceof Error ? err.message : String(err)}: check ARBOR_REDIS_URL`);
  }
  const llama =
    options.llama ??
    new Map([...config.llamaModels].map(([id, path]) => [id, new LlamaCppBackend(path)]));
  const modelsDir = baseModelsDir(config);
  const engines = new EngineHost({
    llama,
    threads: config.engineThreads,
    weights: config.engineWeights,
    modelsDir,
  });
  await engines.refresh();
  for (const { dir, reason } of engines.skipped) {
    logger.warn({ dir }, `base model folder skipped: ${reason}`);
  }
  let worker: EmbeddedWorker | undefined;
  let http: Server | undefined;
  const probes = storeProbes(store, engineProbe(engines), config.roles);
  // The rate limits guard chat, which the calls role does not serve.
  if (rateLimits.backend === "redis" && config.roles.some((role) => role !== "calls"))
    probes.redis = redisProbe(rateLimits);
  if (config.embeddedWorker) {
    const notStarted = { success: false, error: "starting", threads: 0, running: 0 };
    probes.worker = workerProbe(() => worker?.health() ?? notStarted);
  }
  // This process's counters: its requests, chats, and the jobs its embedded worker runs.
  const metrics = new Metrics({
    jobCounts: () => store.jobs.depth(),
    runOperationCounts: () => store.trainingRuns.operationCounts(),
    logger,
  });
  const appConfig = { ...appConfigOf(config), ...options.app };
  const upstreamAdapters = new UpstreamAdapters({
    upstreams: appConfig.upstreams,
    dir: appConfig.upstreamLoraDir,
    blobs: store.blobs,
    logger,
  });
  const app = createApp({
    config: appConfig,
    logger,
    spec: loadSpec(),
    store: options.storeSeenByApp?.(store) ?? store,
    engines,
    probes,
    metrics,
    rateLimits,
    onJobQueued: () => worker?.poke(),
    onJobCancelled: (jobId) => worker?.cancelled(jobId),
    upstreamAdapters,
  });
  let sweeper: NodeJS.Timeout | undefined;
  // What interrupted writes left: partial blobs and files no row names, GGUF export folders in
  // the temp directory, and adapter folders half written for upstreams.
  const swept = (what: string, sweeping: Promise<string[] | SweepResult>) =>
    sweeping.then(
      (swept) => {
        const count = (Array.isArray(swept) ? swept : Object.values(swept).flat()).length;
        if (count > 0) logger.info({ swept }, `removed ${count} ${what}`);
      },
      (err: unknown) => logger.warn({ err }, `could not sweep ${what}`),
    );
  const sweep = () =>
    Promise.all([
      swept("unnamed or partial files", sweepBlobs(store)),
      swept("cut-off GGUF export folders", sweepExports()),
      Object.keys(appConfig.upstreams).length > 0
        ? swept("cut-off adapter folders for upstreams", upstreamAdapters.sweepPartial())
        : undefined,
      // Rate-limit rows of keys and projects idle for a minute, and lapsed leases.
      rateLimits
        .prune(Date.now())
        .catch((err: unknown) => logger.warn({ err }, "could not prune idle rate-limit state")),
    ]);

  const server: ArborServer = {
    config,
    logger,
    app,
    store,
    engines,
    firstStart,
    rateLimits,
    get worker() {
      return worker;
    },
    get http() {
      return http;
    },
    get url() {
      const address = http?.address();
      return typeof address === "object" && address
        ? `http://${config.host}:${address.port}`
        : undefined;
    },
    async start() {
      http = await listen(app, config.port, config.host);
      // What a crash cut off (partial files, files whose row was never written, temporary
      // folders) goes now and hourly.
      await sweep();
      sweeper = setInterval(sweep, 60 * 60_000).unref();
      if (config.embeddedWorker) {
        // Training runs on its own threads, so a step never stalls a request.
        worker = await EmbeddedWorker.start({
          ...workerOptionsOf(config),
          store,
          logger,
          onActivity: (activity) => metrics.training(activity),
        });
      }
    },
    async close() {
      clearInterval(sweeper);
      if (http) {
        const closing = http;
        closing.closeAllConnections();
        await new Promise<void>((resolve) => closing.close(() => resolve()));
      }
      // A running job goes back to the queue, to resume from its last checkpoint.
      await worker?.stop();
      await engines.dispose();
      await rateLimits.close();
      await store.close();
    },
  };
  return server;
}
