import createClient, { type Client, type Middleware } from "openapi-fetch";
import {
  type Core,
  createCore,
  DEFAULT_MAX_RETRIES,
  DEFAULT_TIMEOUT_MS,
  data,
  type RequestOptions,
} from "./core.ts";
import type { components, paths } from "./generated/schema.ts";
import { Calls } from "./resources/calls.ts";
import { Chat, Models, Responses } from "./resources/inference.ts";
import { Training } from "./resources/training.ts";

export interface ArborClientOptions {
  /** Where the server is, e.g. `http://localhost:8080` (no `/v1`: paths carry it). */
  baseUrl: string;
  /** Sent as `Authorization: Bearer <apiKey>`. */
  apiKey?: string;
  /** `<entity>/<project>`, sent as `Compat-Project`: it attributes inference usage. */
  project?: string;
  /** Retries after the first attempt (408/409/429/5xx, connection errors); default 2. */
  maxRetries?: number;
  /** Milliseconds each attempt waits for an answer's headers; default 10 minutes. */
  timeout?: number;
  /** Sent with every request. */
  headers?: Record<string, string>;
  /** Defaults to the global fetch (injected for tests and proxies). */
  fetch?: (request: Request) => Promise<Response>;
  /** Injected for tests; defaults to a timer. */
  sleep?: (ms: number) => Promise<void>;
  /** Injected for tests; the jitter of retry delays. */
  random?: () => number;
}

/** `client.health`: liveness and dependency checks (no key needed). */
export class Health {
  readonly #core: Core;
  constructor(core: Core) {
    this.#core = core;
  }
  retrieve(options?: RequestOptions): Promise<components["schemas"]["Health"]> {
    return data(this.#core.api.GET("/v1/health", { ...this.#core.init(options) }));
  }
  systemCheck(options?: RequestOptions): Promise<components["schemas"]["SystemCheck"]> {
    return data(this.#core.api.GET("/v1/system-check", { ...this.#core.init(options) }));
  }
}

export interface Resources {
  /** OpenAI-compatible chat completions. */
  chat: Chat;
  /** OpenAI's Responses API (stateless), over the same chat path. */
  responses: Responses;
  /** The OpenAI-compatible model listing. */
  models: Models;
  /** Trainable models, checkpoints, datasets and training jobs. */
  training: Training;
  /** Trace ingestion and call usage. */
  calls: Calls;
  health: Health;
}

/** openapi-fetch's raw `GET`/`POST`/… beside the resources. */
export type ArborClient = Client<paths> & Resources;

/** The typed client for all three surfaces: resources that return data or throw the APIError
 * subclass for the status, beside openapi-fetch's raw methods (`{data, error, response}`). */
export function createArborClient(options: ArborClientOptions): ArborClient {
  const baseFetch = options.fetch ?? ((request: Request) => globalThis.fetch(request));
  const sleep =
    options.sleep ?? ((ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms)));
  const retry = {
    fetch: baseFetch,
    sleep,
    random: options.random ?? Math.random,
    maxRetries: options.maxRetries ?? DEFAULT_MAX_RETRIES,
    timeout: options.timeout ?? DEFAULT_TIMEOUT_MS,
  };
  // Raw calls without per-request options use the client-wide retries and timeout.
  const core: Core = createCore(
    createClient<paths>({
      baseUrl: options.baseUrl.replace(/\/+$/, ""),
      fetch: (request) => core.init().fetch(request),
    }),
    retry,
  );
  core.api.use(identity(options));
  const resources: Resources = {
    chat: new Chat(core),
    responses: new Responses(core),
    models: new Models(core),
    training: new Training(core),
    calls: new Calls(core),
    health: new Health(core),
  };
  return Object.assign(core.api, resources);
}

/** Auth, project and request-id headers on every request. */
function identity(options: ArborClientOptions): Middleware {
  return {
    onRequest({ request }) {
      for (const [name, value] of Object.entries(options.headers ?? {}))
        if (!request.headers.has(name)) request.headers.set(name, value);
      if (options.apiKey && !request.headers.has("authorization")) {
        request.headers.set("authorization", `Bearer ${options.apiKey}`);
      }
      if (options.project && !request.headers.has("compat-project")) {
        request.headers.set("compat-project", options.project);
      }
      if (!request.headers.has("x-request-id"))
        request.headers.set("x-request-id", crypto.randomUUID());
      return request;
    },
  };
}
