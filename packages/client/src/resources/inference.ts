import type { Core, RequestOptions } from "../core.ts";
import { data, PagePromise } from "../core.ts";
import { type FetchResult, unwrap } from "../errors.ts";
import type { components } from "../generated/schema.ts";
import { follow } from "../retries.ts";
import { sseJson } from "../sse.ts";

type Schemas = components["schemas"];
export type ChatCompletionCreateParams = Schemas["CreateChatCompletionRequest"];
export type ChatCompletionCreateParamsNonStreaming = ChatCompletionCreateParams & {
  stream?: false | null;
};
export type ChatCompletionCreateParamsStreaming = ChatCompletionCreateParams & { stream: true };
export type ChatCompletion = Schemas["ChatCompletion"];
export type ChatCompletionChunk = Schemas["ChatCompletionChunk"];
export type ModelEntry = Schemas["ModelEntry"];
export type ResponseCreateParams = Schemas["CreateResponseRequest"];
export type ResponseCreateParamsNonStreaming = ResponseCreateParams & { stream?: false | null };
export type ResponseCreateParamsStreaming = ResponseCreateParams & { stream: true };
export type Response = Schemas["Response"];
export type ResponseStreamEvent = Schemas["ResponseStreamEvent"];

/** A streamed answer: iterate it with `for await`; `controller.abort()` stops it (the server
 * stops generating). */
export class Stream<Item> implements AsyncIterable<Item> {
  readonly #iterate: () => AsyncGenerator<Item>;
  readonly controller: AbortController;

  constructor(iterate: () => AsyncGenerator<Item>, controller: AbortController) {
    this.#iterate = iterate;
    this.controller = controller;
  }

  [Symbol.asyncIterator](): AsyncIterator<Item> {
    return this.#iterate();
  }
}

/**
 * Opens a streamed answer: `post` sends the request with these options (an abort signal of the
 * Stream's own, `Accept: text/event-stream`); its body is read as server-sent JSON events up to
 * `[DONE]` or the event `isLast` names. An error status is thrown as an APIError.
 */
async function streamed<Item>(
  core: Core,
  options: RequestOptions,
  post: (init: ReturnType<Core["init"]>) => Promise<FetchResult<unknown>>,
  isLast?: (event: Item) => boolean,
): Promise<Stream<Item>> {
  const controller = new AbortController();
  follow(options.signal, controller);
  const init = core.init({ ...options, signal: controller.signal });
  const result = await post({ ...init, headers: { accept: "text/event-stream", ...init.headers } });
  // openapi-fetch has already read an error's body into `result.error`.
  if (!result.response.ok) unwrap(result);
  const response = result.response;
  return new Stream(() => sseJson<Item>(response, isLast), controller);
}

/** `client.chat.completions`, as openai-node names it. */
export class Completions {
  readonly #core: Core;
  constructor(core: Core) {
    this.#core = core;
  }

  /** A chat completion; with `stream: true`, a Stream of `chat.completion.chunk`s that ends at
   * `data: [DONE]` (an error sent mid-stream is thrown as an APIError). */
  create(
    body: ChatCompletionCreateParamsNonStreaming,
    options?: RequestOptions,
  ): Promise<ChatCompletion>;
  create(
    body: ChatCompletionCreateParamsStreaming,
    options?: RequestOptions,
  ): Promise<Stream<ChatCompletionChunk>>;
  create(
    body: ChatCompletionCreateParams,
    options?: RequestOptions,
  ): Promise<ChatCompletion | Stream<ChatCompletionChunk>>;
  async create(
    body: ChatCompletionCreateParams,
    options: RequestOptions = {},
  ): Promise<ChatCompletion | Stream<ChatCompletionChunk>> {
    const { api } = this.#core;
    if (!body.stream) {
      return data(
        api.POST("/v1/chat/completions", { body, ...this.#core.init(options) }),
      ) as Promise<ChatCompletion>;
    }
    return streamed<ChatCompletionChunk>(this.#core, options, (init) =>
      api.POST("/v1/chat/completions", { body, parseAs: "stream", ...init }),
    );
  }
}

/** `client.responses`, as openai-node names it: OpenAI's Responses API, stateless. */
export class Responses {
  readonly #core: Core;
  constructor(core: Core) {
    this.#core = core;
  }

  /** A response; with `stream: true`, a Stream of Responses events that ends after
   * `response.completed` (or `response.incomplete`). */
  create(body: ResponseCreateParamsNonStreaming, options?: RequestOptions): Promise<Response>;
  create(
    body: ResponseCreateParamsStreaming,
    options?: RequestOptions,
  ): Promise<Stream<ResponseStreamEvent>>;
  create(
    body: ResponseCreateParams,
    options?: RequestOptions,
  ): Promise<Response | Stream<ResponseStreamEvent>>;
  async create(
    body: ResponseCreateParams,
    options: RequestOptions = {},
  ): Promise<Response | Stream<ResponseStreamEvent>> {
    const { api } = this.#core;
    if (!body.stream) {
      return data(
        api.POST("/v1/responses", { body, ...this.#core.init(options) }),
      ) as Promise<Response>;
    }
    const terminal = (e: ResponseStreamEvent) =>
      e.type === "response.completed" || e.type === "response.incomplete";
    return streamed<ResponseStreamEvent>(
      this.#core,
      options,
      (init) => api.POST("/v1/responses", { body, parseAs: "stream", ...init }),
      terminal,
    );
  }
}

export class Chat {
  readonly completions: Completions;
  constructor(core: Core) {
    this.completions = new Completions(core);
  }
}

/** `client.models`: the OpenAI-compatible listing of every model the key can chat with. */
export class Models {
  readonly #core: Core;
  constructor(core: Core) {
    this.#core = core;
  }

  /** Base models and trained models (one page: not paged); `include: "checkpoints"` adds
   * each trained model's `:stepN` checkpoints. */
  list(query: { include?: "checkpoints" } = {}, options?: RequestOptions): PagePromise<ModelEntry> {
    return new PagePromise(() =>
      data(this.#core.api.GET("/v1/models", { params: { query }, ...this.#core.init(options) })),
    );
  }

  retrieve(model: string, options?: RequestOptions): Promise<ModelEntry> {
    return data(
      this.#core.api.GET("/v1/models/{model}", {
        params: { path: { model } },
        ...this.#core.init(options),
      }),
    );
  }
}
