import type { Store } from "@arbor/store";
import type { Handlers } from "../../http/operations.ts";
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

    deleteCheckpoints: ({ params, body, principal }) =>
      deleteCheckpoints(store, principal, params.model_id, body.steps),

    logModelMetrics: ({ params, body, principal }) =>
      logMetrics(store, principal, params.model_id, body),
  };
}
