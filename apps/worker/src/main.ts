/**
 * A separate training worker process, for scale: `DATABASE_URL=postgres://… node apps/worker/src/main.ts`
 * (or `pnpm --filter @arbor/worker start`). Several of them, on several machines, share one
 * PostgreSQL queue; a claim is a lease (FOR UPDATE SKIP LOCKED), so no job runs twice. Run the
 * API servers with ARBOR_EMBEDDED_WORKER=off. Blobs: ARBOR_DATA_DIR (a shared directory).
 * Settings: see the README's Settings (read by @arbor/config).
 */
import { baseModelsDir, readConfig } from "@arbor/config";
import { openStore } from "@arbor/store";
import { baseModels, processIdentity, sftExamplesLoader, TrainingWorker } from "@arbor/training";
import { pino } from "pino";

const config = readConfig();
const logger = pino({ level: config.logLevel });
const store = await openStore({
  dataDir: config.dataDir,
  ...(config.databaseUrl ? { databaseUrl: config.databaseUrl } : {}),
  ...(config.databaseSchema ? { schema: config.databaseSchema } : {}),
});
const worker = new TrainingWorker({
  store,
  logger,
  kernelThreads: config.engineThreads,
  loadBaseModel: baseModels(baseModelsDir(config), { weights: config.engineWeights }),
  loadSftExamples: sftExamplesLoader(store, {
    maxBytes: config.trainingDataMaxBytes,
    allowHosts: config.trainingDataAllowHosts,
  }),
  leaseMs: config.workerLeaseMs,
  // A stable name per replica lets a restarted worker take back its jobs at once.
  identity: processIdentity(config.workerId),
});
worker.start();
logger.info({ workerId: worker.workerId, database: store.dialect }, "training worker started");

async function shutdown(signal: string) {
  logger.info({ signal }, "stopping: a running job goes back to the queue");
  await worker.stop();
  await store.close();
  process.exit(0);
}
process.on("SIGINT", () => void shutdown("SIGINT"));
process.on("SIGTERM", () => void shutdown("SIGTERM"));
