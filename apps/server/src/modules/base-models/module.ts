import type { ServerModule } from "../module.ts";
import { baseModelsHandlers } from "./routes.ts";

/** Base models pulled from the Hugging Face Hub into the engines' folder. */
export const baseModelsModule: ServerModule = {
  name: "base-models",
  handlers: ({ engines, config, logger }) =>
    baseModelsHandlers({
      modelsDir: engines.modelsDir,
      weights: engines.weights,
      hub: config.hub,
      refresh: () => engines.refresh(),
      logger,
    }),
};
