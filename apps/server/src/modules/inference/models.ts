import type { components } from "@arbor/spec/schema";
import { ApiError } from "../../http/errors.ts";
import type { Principal } from "../../http/principal.ts";
import type { EngineHost } from "./engines.ts";
import type { UpstreamConfig, Upstreams } from "./upstream.ts";

type ModelEntry = components["schemas"]["ModelEntry"];

/** What a `model` id in a request resolves to: the engine's base model, and the id that
 * actually served (a trained alias resolves to its `…:step<N>`). */
export interface ResolvedModel {
  /** The id answered in `model` of the completion. */
  id: string;
  baseId: string;
  /** Set when an OpenAI-compatible upstream serves this model instead of the engine. */
  upstream?: UpstreamConfig;
}

/** CONTRACT §6: base ids from the catalogue; unknown (or another entity's) → 404. */
export class ModelDirectory {
  readonly #engines: EngineHost;
  readonly #upstreams: Upstreams;

  constructor(engines: EngineHost, upstreams: Upstreams = {}) {
    this.#engines = engines;
    this.#upstreams = upstreams;
  }

  async list(_principal: Principal): Promise<ModelEntry[]> {
    const base = (id: string, created: number): ModelEntry => ({
      id,
      object: "model",
      created,
      owned_by: "system",
      root: id,
      parent: null,
    });
    const engine = this.#engines.baseModels().map(({ entry, created }) => base(entry.id, created));
    const upstream = Object.keys(this.#upstreams)
      .filter((id) => !this.#engines.baseModel(id))
      .map((id) => base(id, 0));
    return [...engine, ...upstream];
  }

  async retrieve(principal: Principal, id: string): Promise<ModelEntry> {
    const entry = (await this.list(principal)).find((m) => m.id === id);
    if (!entry) throw modelNotFound(id);
    return entry;
  }

  async resolve(_principal: Principal, id: string): Promise<ResolvedModel> {
    const upstream = this.#upstreams[id];
    if (upstream) return { id, baseId: id, upstream };
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
