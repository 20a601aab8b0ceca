import { pipeline } from "node:stream/promises";
import type { ModelConfig } from "@arbor/engine";
import { InvalidInputError, NotFoundError, type Store } from "@arbor/store";
import { checkpointAdapterTar, importAdapter, readAdapterTar, reprDigest } from "@arbor/training";
import { type Handlers, RESPONDED } from "../../http/operations.ts";
import {
  checkpointToWire,
  createModel,
  deleteCheckpoints,
  deleteModel,
  findModel,
  logMetrics,
} from "./service.ts";

export interface ModelsDeps {
  store: Store;
  baseModels: () => Promise<string[]>;
  /** A base model's config (the shapes an uploaded adapter must fit), if the engine serves it. */
  baseConfig: (id: string) => Promise<ModelConfig | undefined>;
}

/** Models and their checkpoints (CONTRACT §5). */
export function modelsHandlers(deps: ModelsDeps): Handlers {
  const { store } = deps;
  return {
    createModel: ({ body, principal }) => createModel(deps, principal, body),
    deleteModel: ({ params, principal }) => deleteModel(store, principal, params.model_id),

    listCheckpoints: async ({ params, query, principal }) => {
      const model = await findModel(store, principal, params.model_id);
      const page = await store.models.listCheckpoints(model.entity, model.id, {
        after: query.after,
        limit: query.limit ?? 20,
        order: query.order ?? "desc",
      });
      return {
        object: "list",
        data: page.data.map((c) => checkpointToWire(model, c)),
        first_id: page.first_id,
        last_id: page.last_id,
        has_more: page.has_more,
      };
    },

    createCheckpoint: async ({ params, req, principal }) => {
      const model = await findModel(store, principal, params.model_id);
      // The raw parser mounted for tar bodies (app.ts) leaves the body as a Buffer.
      const body = Buffer.isBuffer(req.body) ? req.body : Buffer.alloc(0);
      const files = await readAdapterTar(body);
      const baseConfig = await deps.baseConfig(model.base_model);
      if (!baseConfig) {
        throw new InvalidInputError(
          `The model's base ${model.base_model} is not served by the engine here, so it cannot take an adapter.`,
          { code: "unsupported_base_model" },
        );
      }
      return checkpointToWire(model, await importAdapter(store, { model, baseConfig, files }));
    },

    getCheckpointContent: async ({ params, res, principal }): Promise<typeof RESPONDED> => {
      const model = await findModel(store, principal, params.model_id);
      const checkpoint = await store.models.getCheckpoint(model.entity, model.id, params.step);
      if (!checkpoint || !store.blobs) {
        throw new NotFoundError(`Model ${model.id} has no checkpoint at step ${params.step}.`, {
          code: "checkpoint_not_found",
        });
      }
      const label = `${model.name}-step${checkpoint.step}`;
      const archive = await checkpointAdapterTar(store.blobs, checkpoint, label);
      const digest = await reprDigest(archive.open());
      res.status(200);
      res.setHeader("Content-Type", "application/x-tar");
      res.setHeader("Content-Length", String(archive.bytes));
      res.setHeader("Content-Disposition", `attachment; filename="${label}-peft.tar"`);
      res.setHeader("Repr-Digest", digest);
      await pipeline(archive.open(), res);
      return RESPONDED;
    },

    deleteCheckpoints: ({ params, body, principal }) =>
      deleteCheckpoints(store, principal, params.model_id, body.steps),

    logModelMetrics: ({ params, body, principal }) =>
      logMetrics(store, principal, params.model_id, body),
  };
}
