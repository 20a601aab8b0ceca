import type { Store } from "@arbor/store";
import { type Probes, timed } from "./service.ts";

/** Real checks: a database round trip, the queue's depth, the engine's catalogue. */
export function storeProbes(store: Store, engine: Probes["engine"]): Probes {
  return {
    database: async () => ({ ...(await store.ping()) }),
    queue: () =>
      timed(async () => {
        const depth = await store.jobs.depth();
        return { depth: depth.queued };
      }),
    engine,
  };
}

/** The engine probe until an engine is wired in: an honest failure. */
export const noEngine: Probes["engine"] = () =>
  timed(async () => {
    throw new Error("no inference engine is configured");
  });
