import type { ServerModule } from "../module.ts";
import { trainingRunsHandlers } from "./routes.ts";

/** The native training API (ADR 57): runs and their sequenced operations, run by the workers. */
export const trainingRunsModule: ServerModule = {
  name: "training-runs",
  handlers: ({ store, engines, onJobQueued }) =>
    trainingRunsHandlers({ store, engines, ...(onJobQueued ? { onAdmitted: onJobQueued } : {}) }),
};
