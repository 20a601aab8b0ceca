import type { Core, RequestOptions } from "../core.ts";
import { data } from "../core.ts";
import type { components } from "../generated/schema.ts";

type Schemas = components["schemas"];

/** `client.calls`: trace ingestion and token usage summed over call trees. */
export class Calls {
  readonly #core: Core;
  constructor(core: Core) {
    this.#core = core;
  }

  start(
    body: Schemas["CallStartRequest"],
    options?: RequestOptions,
  ): Promise<Schemas["CallStartResponse"]> {
    return data(this.#core.api.POST("/call/start", { body, ...this.#core.init(options) }));
  }

  end(
    body: Schemas["CallEndRequest"],
    options?: RequestOptions,
  ): Promise<Schemas["CallEndResponse"]> {
    return data(this.#core.api.POST("/call/end", { body, ...this.#core.init(options) }));
  }

  upsertBatch(
    body: Schemas["CallUpsertBatchRequest"],
    options?: RequestOptions,
  ): Promise<Schemas["CallUpsertBatchResponse"]> {
    return data(this.#core.api.POST("/call/upsert_batch", { body, ...this.#core.init(options) }));
  }

  query(
    body: Schemas["CallsQueryRequest"],
    options?: RequestOptions,
  ): Promise<Schemas["CallsQueryResponse"]> {
    return data(this.#core.api.POST("/calls/query", { body, ...this.#core.init(options) }));
  }

  delete(
    body: Schemas["CallsDeleteRequest"],
    options?: RequestOptions,
  ): Promise<Schemas["CallsDeleteResponse"]> {
    return data(this.#core.api.POST("/calls/delete", { body, ...this.#core.init(options) }));
  }

  /** Token usage (and costs) summed over each requested call's subtree. */
  usage(
    body: Schemas["CallsUsageRequest"],
    options?: RequestOptions,
  ): Promise<Schemas["CallsUsageResponse"]> {
    return data(this.#core.api.POST("/calls/usage", { body, ...this.#core.init(options) }));
  }

  /** A project's usage (and costs) per UTC day and model, summed from its stored calls. */
  usageByDay(
    body: Schemas["CallsUsageByDayRequest"],
    options?: RequestOptions,
  ): Promise<Schemas["CallsUsageByDayResponse"]> {
    return data(this.#core.api.POST("/calls/usage_by_day", { body, ...this.#core.init(options) }));
  }
}
