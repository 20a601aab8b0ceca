import type { ServerModule } from "../module.ts";
import { metricsEndpoint } from "./routes.ts";

/** `GET /metrics`. (Every request is counted by the app's `requestMetrics`, mounted first.) */
export const metricsModule: ServerModule = {
  name: "metrics",
  beforeAuthentication(app, { config, metrics, authenticate }) {
    // Every role serves it: each process counts its own requests, chats and jobs.
    app.use(metricsEndpoint({ access: config.metrics, metrics, authenticate }));
  },
};
