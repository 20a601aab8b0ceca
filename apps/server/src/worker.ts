import type { Store } from "@arbor/store";
import { TrainingWorker } from "@arbor/worker";
import type { Logger } from "pino";
import { loadTrainingData } from "./modules/datasets/fetch.ts";
import { parseSftJsonl } from "./modules/datasets/jsonl.ts";
import type { EngineHost } from "./modules/inference/engines.ts";

export interface WorkerSettings {
  /** Largest `https://` training file fetched (bytes). */
  maxTrainingDataBytes: number;
  /** Hosts an `https://` training URL may name even when they resolve to private addresses. */
  allowHosts: readonly string[];
  pollMs?: number;
  leaseMs?: number;
}

/** The training worker, sharing the server's store and base models (one copy in memory). */
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
    loadSftExamples: async (entity, url) => {
      const text = await loadTrainingData(store, entity, url, {
        maxBytes: settings.maxTrainingDataBytes,
        allowHosts: settings.allowHosts,
      });
      return parseSftJsonl(text).examples;
    },
    ...(settings.pollMs !== undefined ? { pollMs: settings.pollMs } : {}),
    ...(settings.leaseMs !== undefined ? { leaseMs: settings.leaseMs } : {}),
  });
}
