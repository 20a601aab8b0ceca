import { ConflictError, type Store } from "@arbor/store";
import { modelFilesPrefix } from "@arbor/training";
import { ApiError } from "../../http/errors.ts";
import type { Handlers } from "../../http/operations.ts";
import { checkpointToWire, createModel, findModel, splitMetrics } from "./service.ts";

export interface ModelsDeps {
  store: Store;
  baseModels: () => string[];
}

/** Models and their checkpoints (CONTRACT §5). */
export function modelsHandlers(deps: ModelsDeps): Handlers {
  const { store } = deps;
  return {
    createModel: ({ body, principal }) => createModel(deps, principal!, body),

    deleteModel: async ({ params, principal }) => {
      const model = await findModel(store, principal!, params.model_id);
      // A job still queued or running for the model is cancelled first (its terminal event
      // is written), then the rows and the files go.
      for (const status of ["running", "queued"] as const) {
        const { data } = await store.jobs.list(model.entity, {
          model_id: model.id,
          status,
          limit: 100,
        });
        for (const job of data)
          await store.jobs.cancelJob(model.entity, job.id).catch(() => undefined);
      }
      const deleted = await store.models.delete(model.entity, model.id);
      // Everything under the model's prefix goes, files no row named included.
      await store.blobs?.deletePrefix(modelFilesPrefix(model.id));
      await deleteBlobs(store, deleted.payload_keys);
      return {
        model_id: model.id,
        deleted_checkpoints: deleted.deleted_checkpoints,
        deleted_run: false,
      };
    },

    listCheckpoints: async ({ params, query, principal }) => {
      const model = await findModel(store, principal!, params.model_id);
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

    deleteCheckpoints: async ({ params, body, principal }) => {
      const model = await findModel(store, principal!, params.model_id);
      const result = await store.models
        .deleteCheckpoints(model.entity, model.id, body.steps)
        .catch((err: unknown) => {
          if (err instanceof ConflictError) {
            throw ApiError.conflict(
              `${err.message}: it is what ${model.entity}/${model.project}/${model.name} serves.`,
              "latest_checkpoint",
            );
          }
          throw err;
        });
      await deleteBlobs(store, result.blob_keys);
      return { deleted_count: result.deleted_count, not_found_steps: result.not_found_steps };
    },

    logModelMetrics: async ({ params, body, principal }) => {
      const model = await findModel(store, principal!, params.model_id);
      const metrics = splitMetrics(body.split, body.trajectory_groups);
      const step = model.latest_step ?? 0;
      await store.models.mergeCheckpointMetrics(model.entity, model.id, step, metrics);
      return { step, metrics };
    },
  };
}

/** Files go after their rows: a crash in between leaves unnamed files (swept later), never a
 * row that points at nothing. */
async function deleteBlobs(store: Store, keys: string[]): Promise<void> {
  for (const key of keys) await store.blobs?.deletePrefix(key);
}
