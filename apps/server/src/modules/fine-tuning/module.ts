import type { ServerModule } from "../module.ts";
import { fineTuningHandlers } from "./routes.ts";

/** OpenAI's files and fine-tuning jobs (ADR 70). Uploads are admitted by the models module's
 * upload budget, which covers `POST /v1/files` too; the validator's multer reads their parts. */
export const fineTuningModule: ServerModule = {
  name: "fine-tuning",
  handlers: ({ store, engines, onJobQueued, onJobCancelled }) =>
    fineTuningHandlers({
      store,
      baseModel: (id) => engines.find(id),
      ...(onJobQueued ? { onJobQueued } : {}),
      ...(onJobCancelled ? { onJobCancelled } : {}),
    }),
};
