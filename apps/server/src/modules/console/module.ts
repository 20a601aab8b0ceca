import type { ServerModule } from "../module.ts";
import { consoleRoutes } from "./routes.ts";

/** The web console's files, public. */
export const consoleModule: ServerModule = {
  name: "console",
  beforeAuthentication(app, { config }) {
    app.use(consoleRoutes(config.adminKeyPath ?? null));
  },
};
