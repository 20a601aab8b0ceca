import type { components } from "@arbor/spec/schema";
import { ApiError } from "../../http/errors.ts";
import type { Principal } from "../../http/principal.ts";
import type { EngineHost } from "./engines.ts";

type ModelEntry = components["schemas"]["ModelEntry"];

/** What a `model` id in a request resolves to: the engine's base model, and the id that
 * actually served (a trained alias resolves to its `…:step<N>`). */
export interface ResolvedModel {
  /** The id answered in `model` of the completion. */
  id: string;
  baseId: string;
}

/** CONTRACT §6: base ids from the catalogue; unknown (or another entity's) → 404. */
export class ModelDirectory {
  readonly #engines: EngineHost;

  constructor(engines: EngineHost) {
    this.#engines = engines;
  }

  async list(_principal: Principal): Promise<ModelEntry[]> {
    return this.#engines.baseModels().map(({ entry, created }) => ({
      id: entry.id,
      object: "model",
      created,
      owned_by: "system",
      root: entry.id,
      parent: null,
    }));
  }

  async retrieve(principal: Principal, id: string): Promise<ModelEntry> {
    const entry = (await this.list(principal)).find((m) => m.id === id);
    if (!entry) throw modelNotFound(id);
    return entry;
  }

  async resolve(_principal: Principal, id: string): Promise<ResolvedModel> {
    const base = this.#engines.baseModel(id);
    if (!base) throw modelNotFound(id);
    return { id, baseId: id };
  }
}

export function modelNotFound(id: string): ApiError {
  return new ApiError(404, `The model "${id}" does not exist or you do not have access to it.`, {
    code: "model_not_found",
    param: "model",
  });
}
