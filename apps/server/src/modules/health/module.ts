import type { ServerModule } from "../module.ts";
import { healthHandlers } from "./routes.ts";

/** `/v1/health` and `/v1/system-check`, public. */
export const healthModule: ServerModule = {
  name: "health",
  handlers: ({ probes }) => healthHandlers(probes),
};
