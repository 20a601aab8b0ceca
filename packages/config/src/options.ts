import { type BlobBackend, baseModelsDir, type Config, type EngineWeights } from "./settings.ts";

/**
 * What the settings make of the store and of the training worker, written once for every
 * process that opens them: the server, the worker processes and the CLI. The shapes are those of
 * @arbor/store's `openStore` and @arbor/training's `EmbeddedWorker.start`, which this package
 * does not depend on; the compiler checks them where they are passed.
 */

/** `openStore`'s options: SQLite in the data directory, or PostgreSQL with `DATABASE_URL`. */
export interface StoreConfig {
  dataDir: string;
  databaseUrl: string | undefined;
  schema: string | undefined;
  blobs: BlobBackend | undefined;
}

export function storeOptionsOf(config: Config): StoreConfig {
  return {
    dataDir: config.dataDir,
    databaseUrl: config.databaseUrl,
    schema: config.databaseSchema,
    blobs: config.blobs,
  };
}

/** `EmbeddedWorker.start`'s settings (its training threads open the same store); the process
 * adds its store, logger, and its identity or activity listener. */
export interface WorkerConfig extends StoreConfig {
  threads: number;
  logLevel: string;
  leaseMs: number;
  maxTrainingDataBytes: number;
  allowHosts: string[];
  kernelThreads: number;
  engineWeights: EngineWeights;
  baseModelsDir: string;
}

export function workerOptionsOf(config: Config): WorkerConfig {
  return {
    ...storeOptionsOf(config),
    threads: config.trainingThreads,
    logLevel: config.logLevel,
    leaseMs: config.workerLeaseMs,
    maxTrainingDataBytes: config.trainingDataMaxBytes,
    allowHosts: config.trainingDataAllowHosts,
    kernelThreads: config.engineThreads,
    engineWeights: config.engineWeights,
    baseModelsDir: baseModelsDir(config),
  };
}
