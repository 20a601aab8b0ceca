import type { components, paths } from "@arbor/spec/schema";
import createClient, { type Client, type Middleware } from "openapi-fetch";
import { type FetchResult, unwrap } from "./errors.ts";
import { retryingFetch } from "./retries.ts";
import { sseJson } from "./sse.ts";

type Schemas = components["schemas"];
export type ChatCompletionRequest = Schemas["CreateChatCompletionRequest"];
export type ChatCompletionChunk = Schemas["ChatCompletionChunk"];
export type ChatCompletion = Schemas["ChatCompletion"];
export type TrainingJobEvent = Schemas["TrainingJobEvent"];
export type TrainingJobEventList = Schemas["TrainingJobEventList"];
export type Checkpoint = Schemas["Checkpoint"];
/** `peft`: PEFT's two files in a tar; `gguf`: the base with the adapter merged; `gguf-lora`:
 * the adapter as a llama.cpp LoRA GGUF. */
export type CheckpointFormat = NonNullable<
  NonNullable<
    paths["/v1/preview/models/{model_id}/checkpoints/{step}/content"]["get"]["parameters"]["query"]
  >["format"]
>;

/** A checkpoint's weights as they stream, with what the server states of them. */
export interface CheckpointContent {
  body: ReadableStream<Uint8Array>;
  /** Content-Length. */
  bytes: number;
  /** Repr-Digest: `sha-256=:<base64>:` (RFC 9530). */
  digest: string | null;
  /** The file name of Content-Disposition. */
  filename: string | null;
}

export interface ArborClientOptions {
  /** Where the server is, e.g. `http://localhost:8080` (no `/v1`: paths carry it). */
  baseUrl: string;
  /** Sent as `Authorization: Bearer <apiKey>`. */
  apiKey?: string;
  /** `<entity>/<project>`, sent as `Compat-Project`: it attributes inference usage. */
  project?: string;
  /** Retries after the first attempt (408/409/429/5xx, connection errors); default 2. */
  maxRetries?: number;
  /** Injected for tests; defaults to the global fetch. */
  fetch?: (request: Request) => Promise<Response>;
  /** Injected for tests; defaults to a timer. */
  sleep?: (ms: number) => Promise<void>;
  random?: () => number;
  headers?: Record<string, string>;
}

const terminalEventTypes = new Set(["training_ended", "training_failed"]);

export type ArborClient = Client<paths> & ReturnType<typeof helpers>;

/** The typed client for all three surfaces. Calls return openapi-fetch's `{data, error,
 * response}`; `unwrap()` turns an error into the APIError subclass for its status. */
export function createArborClient(options: ArborClientOptions): ArborClient {
  const baseFetch = options.fetch ?? ((request: Request) => globalThis.fetch(request));
  const sleep =
    options.sleep ?? ((ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms)));
  const api = createClient<paths>({
    baseUrl: options.baseUrl.replace(/\/+$/, ""),
    fetch: retryingFetch({
      maxRetries: options.maxRetries ?? 2,
      fetch: baseFetch,
      sleep,
      random: options.random ?? Math.random,
    }),
  });
  api.use(identity(options));
  return Object.assign(api, helpers(api, sleep));
}

/** Auth, project and request-id headers on every request. */
function identity(options: ArborClientOptions): Middleware {
  return {
    onRequest({ request }) {
      for (const [name, value] of Object.entries(options.headers ?? {}))
        request.headers.set(name, value);
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

interface Page<T> {
  data: T[];
  has_more: boolean;
  last_id?: string | null;
}

/** Pause before following a job's events again after the stream closed without its end. */
const reconnectDelayMs = 1000;

function helpers(api: Client<paths>, sleep: (ms: number) => Promise<void>) {
  return {
    /** A whole (non-streamed) chat completion, typed as `chat.completion`. */
    async createChatCompletion(
      body: Omit<ChatCompletionRequest, "stream" | "stream_options">,
      init: { signal?: AbortSignal; headers?: Record<string, string> } = {},
    ): Promise<FetchResult<ChatCompletion>> {
      const result = await api.POST("/v1/chat/completions", {
        body: { ...body, stream: false } as ChatCompletionRequest,
        headers: init.headers,
        signal: init.signal,
      });
      return result as FetchResult<ChatCompletion>;
    },

    /** One page of a job's events as JSON (the same path streams with `followTrainingJob`). */
    async listTrainingJobEvents(
      trainingJobId: string,
      query: { after?: string | undefined; limit?: number } = {},
    ): Promise<FetchResult<TrainingJobEventList>> {
      const result = await api.GET("/v1/preview/training-jobs/{training_job_id}/events", {
        params: { path: { training_job_id: trainingJobId }, query },
        headers: { accept: "application/json" },
      });
      return result as FetchResult<TrainingJobEventList>;
    },

    /** Streams a chat completion: yields each `chat.completion.chunk` until `[DONE]`. */
    async *streamChatCompletion(
      body: Omit<ChatCompletionRequest, "stream">,
      init: { signal?: AbortSignal; headers?: Record<string, string> } = {},
    ): AsyncGenerator<ChatCompletionChunk> {
      const result = await api.POST("/v1/chat/completions", {
        body: { ...body, stream: true } as ChatCompletionRequest,
        parseAs: "stream",
        headers: { accept: "text/event-stream", ...init.headers },
        signal: init.signal,
      });
      // openapi-fetch has already read an error's body into `result.error`.
      if (!result.response.ok) unwrap(result);
      yield* sseJson<ChatCompletionChunk>(result.response);
    },

    /** A checkpoint's weights, streamed (`getCheckpointContent`); throws the API error. */
    async downloadCheckpoint(
      modelId: string,
      step: number,
      format: CheckpointFormat = "peft",
      init: { signal?: AbortSignal } = {},
    ): Promise<CheckpointContent> {
      const result = await api.GET("/v1/preview/models/{model_id}/checkpoints/{step}/content", {
        params: { path: { model_id: modelId, step }, query: { format } },
        parseAs: "stream",
        signal: init.signal,
      });
      // openapi-fetch has already read an error's body into `result.error`.
      if (!result.response.ok || !result.data) unwrap(result);
      const headers = result.response.headers;
      return {
        body: result.data as ReadableStream<Uint8Array>,
        bytes: Number(headers.get("content-length")),
        digest: headers.get("repr-digest"),
        filename: /filename="([^"]+)"/.exec(headers.get("content-disposition") ?? "")?.[1] ?? null,
      };
    },

    /** Adds a PEFT adapter, as a tar (gzipped or not), as the model's next checkpoint
     * (`createCheckpoint`). */
    async uploadCheckpoint(
      modelId: string,
      tar: Uint8Array,
      init: { signal?: AbortSignal } = {},
    ): Promise<FetchResult<Checkpoint>> {
      const gzipped = tar[0] === 0x1f && tar[1] === 0x8b;
      const result = await api.POST("/v1/preview/models/{model_id}/checkpoints", {
        params: { path: { model_id: modelId } },
        // The spec types a binary body as a string; fetch sends the bytes as they are.
        body: tar as unknown as string,
        bodySerializer: (bytes: unknown) => bytes as string,
        headers: { "content-type": gzipped ? "application/gzip" : "application/x-tar" },
        signal: init.signal,
      });
      return result as FetchResult<Checkpoint>;
    },

    /** Pages through any list: `fetchPage(after)` returns one openapi-fetch result. */
    async *paginate<T extends { id: string }>(
      fetchPage: (after: string | undefined) => Promise<FetchResult<Page<T>>>,
    ): AsyncGenerator<T> {
      let after: string | undefined;
      for (;;) {
        const page = unwrap(await fetchPage(after));
        yield* page.data;
        const last = page.data.at(-1)?.id ?? page.last_id ?? undefined;
        if (!page.has_more || !last) return;
        after = last;
      }
    },

    /** Yields a training job's events live until its terminal event (`training_ended` or
     * `training_failed`). Reconnects after a dropped stream from the last event seen. */
    async *followTrainingJob(
      trainingJobId: string,
      init: { signal?: AbortSignal; after?: string } = {},
    ): AsyncGenerator<TrainingJobEvent> {
      let after = init.after;
      for (;;) {
        const result = await api.GET("/v1/preview/training-jobs/{training_job_id}/events", {
          params: { path: { training_job_id: trainingJobId }, query: after ? { after } : {} },
          parseAs: "stream",
          headers: { accept: "text/event-stream" },
          signal: init.signal,
        });
        if (!result.response.ok) unwrap(result);
        for await (const event of sseJson<TrainingJobEvent>(result.response)) {
          yield event;
          after = event.id;
          if (terminalEventTypes.has(event.type)) return;
        }
        if (init.signal?.aborted) return;
        await sleep(reconnectDelayMs);
      }
    },
  };
}
