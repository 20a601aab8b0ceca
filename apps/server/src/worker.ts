import type { Store } from "@arbor/store";
import { sftExamplesLoader, TrainingWorker } from "@arbor/worker";
import type { Logger } from "pino";
import type { EngineHost } from "./modules/inference/engines.ts";

export interface WorkerSettings {
  /** Largest `https://` training file fetched (bytes). */
  maxTrainingDataBytes: number;
  /** Hosts an `https://` training URL may name even when they resolve to private addresses. */
  allowHosts: readonly string[];
  pollMs?: number;
  leaseMs?: number;
}

/** The embedded training worker, sharing the server's store and base models (one copy in
 * memory). A separate process for scale is `apps/worker/src/main.ts`. */
export function createTrainingWorker(
  store: Store,
  engines: EngineHost,
  logger: Logger,
  settings: WorkerSettings,
): TrainingWorker {
  return new TrainingWorker({
    store,
    logger: logger.child({ component: "worker" }),
    loadBaseModel: async (baseId) => (await engines.engine(baseId)).model,
    loadSftExamples: sftExamplesLoader(store, {
      maxBytes: settings.maxTrainingDataBytes,
      allowHosts: settings.allowHosts,
    }),
    ...(settings.pollMs !== undefined ? { pollMs: settings.pollMs } : {}),
    ...(settings.leaseMs !== undefined ? { leaseMs: settings.leaseMs } : {}),
  });
}
