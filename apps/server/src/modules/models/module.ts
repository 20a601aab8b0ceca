import { UploadBudget, uploadAdmission } from "../../http/uploads.ts";
import type { ServerModule } from "../module.ts";
import { modelsHandlers } from "./routes.ts";

/** Trainable models and their checkpoints, uploaded and downloaded. */
export const modelsModule: ServerModule = {
  name: "models",
  beforeValidation(app, { config }) {
    // Adapter uploads take their share of the upload budget before anything reads their body;
    // a tar is then read as it arrives by the handler (multipart parts by the validator's multer).
    app.use(uploadAdmission(new UploadBudget(config.uploadMemoryBytes)));
  },
  handlers: ({ store, engines, upstreamAdapters }) =>
    modelsHandlers({
      store,
      baseModels: async () => (await engines.current()).map((m) => m.id),
      baseModel: (id) => engines.find(id),
      checkpointsDeleted: (model, blobKeys) => upstreamAdapters.deleted(model.base_model, blobKeys),
    }),
};
