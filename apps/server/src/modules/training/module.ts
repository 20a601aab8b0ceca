import type { ServerModule } from "../module.ts";
import { trainingHandlers } from "./routes.ts";

/** Training jobs, queued for the workers. */
export const trainingModule: ServerModule = {
  name: "training",
  handlers: ({ store, onJobQueued, onJobCancelled }) =>
    trainingHandlers({
      store,
      ...(onJobQueued ? { onJobQueued } : {}),
      ...(onJobCancelled ? { onJobCancelled } : {}),
    }),
};
