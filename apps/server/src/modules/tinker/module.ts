import type { ServerModule } from "../module.ts";
import { TINKER_PREFIX, tinkerRouter } from "./routes.ts";

/**
 * Tinker's API (ADR 71) under `/tinker/api/v1`, on the training surface: mounted before the
 * app's authentication and validator, since the protocol is Tinker's (protobuf bodies,
 * `X-API-Key`, its own error shape), specified by `spec/tinker/tinker_public.proto` and
 * docs/tinker.md rather than by the OpenAPI document.
 */
export const tinkerModule: ServerModule = {
  name: "tinker",
  beforeAuthentication(app, { config, store, engines, authenticate, logger, onJobQueued }) {
    if (!config.roles.includes("training")) return;
    app.use(
      TINKER_PREFIX,
      tinkerRouter({
        store,
        engines,
        authenticate,
        logger,
        ...(onJobQueued ? { onAdmitted: onJobQueued } : {}),
      }),
    );
  },
};
