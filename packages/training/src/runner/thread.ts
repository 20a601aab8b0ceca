/**
 * The embedded training worker, on its own thread: training steps are CPU-bound, and on the
 * server's thread they would stall every HTTP request while a step runs. The thread opens its
 * own connection to the same store and loads its own copy of the base models. It tells its
 * supervisor (`EmbeddedWorker`) who it is and which job it runs, so a death fails that job.
 */
import { parentPort, workerData } from "node:worker_threads";
import type { WeightChoice } from "@arbor/engine/model";
import { type BlobBackend, openStore } from "@arbor/store";
import { pino } from "pino";
import { baseModels, dpoPairsLoader, sftExamplesLoader } from "./loaders.ts";
import { type TrainingActivity, TrainingWorker } from "./runner.ts";

export interface WorkerThreadSettings {
  dataDir: string;
  databaseUrl?: string | undefined;
  schema?: string | undefined;
  /** Where blobs live (`ARBOR_BLOBS`); the store's default when unset. */
  blobs?: BlobBackend | undefined;
  logLevel: string;
  leaseMs: number;
  maxTrainingDataBytes: number;
  allowHosts: string[];
  /** Kernel threads of this training thread's engine. */
  kernelThreads: number;
  /** How its engine keeps base models' weights (ARBOR_ENGINE_WEIGHTS). */
  engineWeights: WeightChoice;
  /** Where base-model folders are (besides the shipped models). */
  baseModelsDir?: string | undefined;
}

/** What the supervisor gives each thread besides its settings. */
export interface ThreadData extends WorkerThreadSettings {
  identity: { stable: string; persistent: boolean };
  /** Shared with the supervisor: the id of a job cancelled in this process (`writeCancelled`),
   * and whether the worker is stopping (`writeStopping`). */
  cancelled: Int32Array;
}

/** What a thread tells its supervisor. */
export type ThreadReport =
  | { type: "started"; workerId: string }
  | { type: "job"; jobId: string | null; jobType?: "sft" | "rl" }
  | { type: "activity"; activity: TrainingActivity }
  | { type: "stopped" };

const settings = workerData as ThreadData;
const report = (message: ThreadReport) => parentPort?.postMessage(message);
const logger = pino({ level: settings.logLevel }).child({ component: "worker" });
const { dataDir, databaseUrl, schema, blobs } = settings;
const store = await openStore({ dataDir, databaseUrl, schema, blobs });
const worker = new TrainingWorker({
  store,
  logger,
  identity: settings.identity,
  leaseMs: settings.leaseMs,
  kernelThreads: settings.kernelThreads,
  loadBaseModel: baseModels(settings.baseModelsDir, { weights: settings.engineWeights }),
  loadSftExamples: sftExamplesLoader(store, {
    maxBytes: settings.maxTrainingDataBytes,
    allowHosts: settings.allowHosts,
  }),
  loadDpoPairs: dpoPairsLoader(store, {
    maxBytes: settings.maxTrainingDataBytes,
    allowHosts: settings.allowHosts,
  }),
  onJob: (jobId, jobType) => report({ type: "job", jobId, ...(jobType ? { jobType } : {}) }),
  onActivity: (activity) => report({ type: "activity", activity }),
  cancelled: settings.cancelled,
});
worker.start();
parentPort?.on("message", (message: unknown) => {
  if (message === "poke") worker.poke();
  if (message === "stop") {
    // A running job goes back to the queue, to resume from its last checkpoint.
    void worker
      .stop()
      .then(() => store.close())
      .then(() => report({ type: "stopped" }));
  }
});
report({ type: "started", workerId: worker.workerId });
