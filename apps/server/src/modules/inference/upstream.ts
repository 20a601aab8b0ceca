import type { UpstreamConfig } from "@arbor/config";
import type { components } from "@arbor/spec/schema";
import {
  ConflictError,
  DomainError,
  InvalidInputError,
  NotFoundError,
  UnavailableError,
} from "@arbor/store";
import { EventSourceParserStream } from "eventsource-parser/stream";
import type { ChatRequest } from "./chat.ts";
import { CheckpointGoneError } from "./engines.ts";
import { modelNotFound, type ResolvedModel } from "./models.ts";
import type { ChatBackend, ChatEvent, PreparedChat, ToolCallDelta } from "./service.ts";
import type { UpstreamAdapters } from "./upstream-lora.ts";

type ChatCompletionChunk = components["schemas"]["ChatCompletionChunk"];

/**
 * An OpenAI-compatible upstream (vLLM, SGLang, llama.cpp server, another Arbor). The request is
 * forwarded as sent, under the upstream's model name, and always streamed with its usage, so
 * that one path serves both kinds of request and the usage is always there to record. Its
 * refusals come back in our envelope; its own credentials or outages are our 503.
 *
 * A trained checkpoint of a base the upstream serves goes there as its LoRA adapter (ADR 40):
 * registered with the upstream before its first request and asked for by its adapter's name.
 */
export class UpstreamChatBackend implements ChatBackend<UpstreamModel> {
  readonly #adapters: UpstreamAdapters;

  constructor(adapters: UpstreamAdapters) {
    this.#adapters = adapters;
  }

  async prepare(resolved: UpstreamModel, body: ChatRequest): Promise<PreparedChat> {
    const { upstream } = resolved;
    const outgoing = { ...body, stream: true, stream_options: { include_usage: true } };
    const blobKey = resolved.checkpoint?.blob_key;
    if (!blobKey) {
      // A base model, or a checkpoint without files (step 0): the base itself.
      const model = upstream.model ?? resolved.baseId;
      return {
        promptTokens: 0,
        start: async (signal) =>
          upstreamEvents(await postUpstream(upstream, { ...outgoing, model }, signal)),
      };
    }
    // Its files are put where the upstream reads them before the call is recorded: a
    // checkpoint deleted since it was resolved is a 404 like any unknown model.
    await this.#adapters.materialise(blobKey).catch(notFoundIfGone(resolved.id));
    return {
      promptTokens: 0,
      start: (signal) =>
        this.#startAdapter(upstream, blobKey, outgoing, signal).catch(notFoundIfGone(resolved.id)),
    };
  }

  /**
   * Registers the adapter (once, however many requests ask at the same time) and asks for it by
   * name. An upstream that answers that it does not know the name (it restarted, or another
   * replica unloaded it) has it registered again, and the request is sent once more.
   */
  async #startAdapter(
    upstream: UpstreamConfig,
    blobKey: string,
    outgoing: Record<string, unknown>,
    signal: AbortSignal,
  ): Promise<AsyncIterable<ChatEvent>> {
    for (let attempt = 1; ; attempt++) {
      const lease = await this.#adapters.acquire(upstream, blobKey, signal);
      let response: Response;
      try {
        response = await sendUpstream(upstream, { ...outgoing, model: lease.name }, signal);
      } finally {
        // Once its headers are in, the upstream has taken the adapter for this request: it may
        // be unloaded for another from now on.
        lease.release();
      }
      if (response.ok) return upstreamEvents(response);
      const message = await upstreamMessage(response);
      if (!forgot(response.status, message, lease.name)) {
        throw failure(response.status, message, response.headers);
      }
      if (attempt === 2) {
        throw unavailable(
          `the upstream does not serve the adapter it just loaded (${response.status}: ${message})`,
        );
      }
      this.#adapters.forgotten(lease);
    }
  }
}

type UpstreamModel = Extract<ResolvedModel, { kind: "upstream" }>;

/** The upstream's answer that it has no model of that name: vLLM's 404 "The model `…` does not
 * exist.", or a 400 that names the adapter (a resolver that found it but could not load it). */
function forgot(status: number, message: string, name: string): boolean {
  return status === 404 || (status === 400 && message.includes(name));
}

function notFoundIfGone(id: string) {
  return (err: unknown): never => {
    if (err instanceof CheckpointGoneError) throw modelNotFound(id);
    throw err;
  };
}

/** The events of an upstream's accepted streaming response. */
async function* upstreamEvents(response: Response): AsyncGenerator<ChatEvent> {
  for await (const chunk of upstreamChunks(response)) {
    for (const choice of chunk.choices ?? []) {
      const content = choice.delta?.content ?? "";
      const logprobs = choice.logprobs?.content ?? undefined;
      if (content || logprobs) {
        yield {
          type: "delta",
          choice: choice.index,
          content,
          // A chunk carries about one token; the upstream's own usage, asked for, replaces this.
          tokens: content ? 1 : 0,
          ...(logprobs ? { logprobs } : {}),
        };
      }
      for (const call of choice.delta?.tool_calls ?? []) {
        yield { type: "tool_call", choice: choice.index, delta: knownFields(call) };
      }
      if (choice.finish_reason) {
        yield {
          type: "finish",
          choice: choice.index,
          content: "",
          finishReason:
            choice.finish_reason === "length" || choice.finish_reason === "tool_calls"
              ? choice.finish_reason
              : "stop",
        };
      }
    }
    if (chunk.usage) {
      yield {
        type: "usage",
        promptTokens: chunk.usage.prompt_tokens ?? 0,
        completionTokens: chunk.usage.completion_tokens ?? 0,
      };
    }
  }
}

/** An upstream's piece of a tool call with the fields our chunks have (they allow no others). */
function knownFields(call: ToolCallDelta): ToolCallDelta {
  const fn = {
    ...(call.function?.name ? { name: call.function.name } : {}),
    ...(call.function?.arguments !== undefined ? { arguments: call.function.arguments } : {}),
  };
  return {
    index: call.index,
    ...(call.id ? { id: call.id } : {}),
    ...(call.type ? { type: call.type } : {}),
    ...(Object.keys(fn).length > 0 ? { function: fn } : {}),
  };
}

/** Sends the chat request upstream. A refusal comes back as our envelope; the upstream's
 * own credentials or outages are our 503, never its internals. */
async function postUpstream(
  upstream: UpstreamConfig,
  body: Record<string, unknown>,
  signal: AbortSignal,
): Promise<Response> {
  const response = await sendUpstream(upstream, body, signal);
  if (response.ok) return response;
  throw failure(response.status, await upstreamMessage(response), response.headers);
}

/** POSTs `body` to the upstream's chat completions; only an unreachable upstream throws. */
async function sendUpstream(
  upstream: UpstreamConfig,
  body: Record<string, unknown>,
  signal: AbortSignal,
): Promise<Response> {
  try {
    return await fetch(`${upstreamBase(upstream)}/chat/completions`, {
      method: "POST",
      headers: {
        "content-type": "application/json",
        accept: body.stream ? "text/event-stream" : "application/json",
        ...upstreamAuth(upstream),
      },
      body: JSON.stringify(body),
      signal,
    });
  } catch (err) {
    if (signal.aborted) throw err;
    throw unavailable(
      `the upstream for this model is unreachable (${err instanceof Error ? err.message : String(err)})`,
    );
  }
}

/** The upstream's base URL (its `/v1`), without a trailing slash. */
export function upstreamBase(upstream: UpstreamConfig): string {
  return upstream.url.replace(/\/+$/, "");
}

export function upstreamAuth(upstream: UpstreamConfig): Record<string, string> {
  return upstream.apiKey ? { authorization: `Bearer ${upstream.apiKey}` } : {};
}

/** What a failed answer says: OpenAI's and vLLM's `error.message`, older vLLM's top-level
 * `message`, FastAPI's `detail`, or the text itself. */
export async function upstreamMessage(response: Response): Promise<string> {
  const text = await response.text().catch(() => "");
  try {
    const parsed = JSON.parse(text) as {
      error?: { message?: string };
      detail?: unknown;
      message?: string;
    };
    return (
      parsed.error?.message ??
      (typeof parsed.detail === "string" ? parsed.detail : undefined) ??
      parsed.message ??
      text.slice(0, 500)
    );
  } catch {
    return text.slice(0, 500);
  }
}

/** A failed chat answer as our error: the upstream's credentials or outages are a 503. */
function failure(status: number, message: string, headers: Headers): DomainError {
  if (status === 401 || status === 403 || status >= 500) {
    return unavailable(`the upstream for this model failed (${status}: ${message})`);
  }
  return refusal(status, message || `upstream answered ${status}`, headers);
}

/** An upstream's 4xx as the domain error of the same meaning. */
function refusal(status: number, message: string, headers: Headers): DomainError {
  switch (status) {
    case 404:
      return new NotFoundError(message, { code: "model_not_found" });
    case 409:
      return new ConflictError(message);
    case 413:
      return new DomainError("too_large", message, { code: "request_too_large" });
    case 429:
      return new DomainError("rate_limited", `The upstream is rate limiting: ${message}`, {
        code: "rate_limit_exceeded",
        retryAfterSeconds: retryAfterSeconds(headers.get("retry-after")),
      });
    default:
      return new InvalidInputError(message);
  }
}

/** `Retry-After` as seconds from now: a number, or an HTTP date; 1 when absent or unreadable. */
function retryAfterSeconds(value: string | null): number {
  if (!value) return 1;
  const seconds = Number(value);
  if (Number.isFinite(seconds) && seconds >= 0) return Math.ceil(seconds);
  const at = Date.parse(value);
  return Number.isNaN(at) ? 1 : Math.max(1, Math.ceil((at - Date.now()) / 1000));
}

export function unavailable(message: string): UnavailableError {
  return new UnavailableError(`Service unavailable: ${message}.`, { retryAfterSeconds: 5 });
}

/** The chunks of an upstream SSE response, until `[DONE]`; an error event is thrown. */
async function* upstreamChunks(response: Response): AsyncGenerator<ChatCompletionChunk> {
  if (!response.body) return;
  const reader = response.body
    .pipeThrough(new TextDecoderStream())
    .pipeThrough(new EventSourceParserStream())
    .getReader();
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done || value.data === "[DONE]") return;
      const payload = JSON.parse(value.data) as
        | ChatCompletionChunk
        | { error: { message?: string } };
      if ("error" in payload)
        throw unavailable(`the upstream failed mid-stream (${payload.error.message ?? "error"})`);
      yield payload;
    }
  } finally {
    await reader.cancel().catch(() => {});
  }
}
