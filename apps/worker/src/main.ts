/**
 * A separate training worker process, for scale: `DATABASE_URL=postgres://… node apps/worker/src/main.ts`
 * (or `pnpm --filter @arbor/worker start`). Several of them, on several machines, share one
 * PostgreSQL queue; a claim is a lease (FOR UPDATE SKIP LOCKED), so no job runs twice. Run the
 * API servers without the `training` role, or with ARBOR_EMBEDDED_WORKER=off. Blobs: in
 * PostgreSQL (or, with ARBOR_BLOBS=fs, ARBOR_DATA_DIR/blobs, a directory every process shares).
 * Settings: see the README's Settings (read by @arbor/config).
 */
import { readConfig, storeOptionsOf, workerOptionsOf } from "@arbor/config";
import { checkFilesLeftInDataDir, openStore } from "@arbor/store";
import { EmbeddedWorker, processIdentity, sweepBlobs } from "@arbor/training";
import { pino } from "pino";

const config = readConfig();
const logger = pino({ level: config.logLevel });
const store = await openStore(storeOptionsOf(config));
// Blobs moved into PostgreSQL by default: a data directory's files are never left unseen.
const left = await checkFilesLeftInDataDir(store, config.dataDir, config.blobs !== undefined);
if (left) logger.warn({ dataDir: config.dataDir }, left);
// Partial files a killed worker of this host left (blobs kept in files), now and hourly: only a
// process of the same host can tell that their writer is gone before they are a day old.
const sweep = () =>
  sweepBlobs(store).then(
    (swept) => {
      const count = Object.values(swept).flat().length;
      if (count > 0) logger.info({ swept }, `removed ${count} unnamed or partial files`);
    },
    (err: unknown) => logger.warn({ err }, "could not sweep unnamed or partial files"),
  );
await sweep();
const sweeper = setInterval(sweep, 60 * 60_000).unref();
// The same supervised training threads as the server's embedded worker: this thread stays free
// to watch for cancels (made through any replica's API), so a job stops between micro-batches.
const identity = processIdentity(config.workerId);
const worker = await EmbeddedWorker.start({
  ...workerOptionsOf(config),
  store,
  logger,
  identity,
});
logger.info(
  { workerId: identity.stable, threads: config.trainingThreads, database: store.dialect },
  "training worker started",
);

async function shutdown(signal: string) {
  logger.info({ signal }, "stopping: a running job goes back to the queue");
  clearInterval(sweeper);
  await worker.stop();
  await store.close();
  process.exit(0);
}
process.on("SIGINT", () => void shutdown("SIGINT"));
process.on("SIGTERM", () => void shutdown("SIGTERM"));
