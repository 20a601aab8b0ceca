/**
 * A separate training worker process, for scale: `DATABASE_URL=postgres://… node apps/worker/src/main.ts`
 * (or `pnpm --filter @arbor/worker start`). Several of them, on several machines, share one
 * PostgreSQL queue; a claim is a lease (FOR UPDATE SKIP LOCKED), so no job runs twice. Run the
 * API servers with ARBOR_EMBEDDED_WORKER=off. Blobs: ARBOR_DATA_DIR (a shared directory).
 */
import { openStore, storeOptionsFromEnv } from "@arbor/store";
import { pino } from "pino";
import { processIdentity } from "./identity.ts";
import { catalogModels, sftExamplesLoader } from "./loaders.ts";
import { TrainingWorker } from "./runner.ts";
import { workerSettingsFromEnv } from "./settings.ts";

const env = process.env;
const logger = pino({ level: env.ARBOR_LOG_LEVEL ?? "info" });
const settings = workerSettingsFromEnv(env);
const store = await openStore(storeOptionsFromEnv(env));
const worker = new TrainingWorker({
  store,
  logger,
  loadBaseModel: catalogModels(),
  loadSftExamples: sftExamplesLoader(store, {
    maxBytes: settings.maxTrainingDataBytes,
    allowHosts: settings.allowHosts,
  }),
  leaseMs: settings.leaseMs,
  // ARBOR_WORKER_ID: a stable name per replica lets a restarted worker take back its jobs at once.
  identity: processIdentity(env.ARBOR_WORKER_ID || undefined),
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
