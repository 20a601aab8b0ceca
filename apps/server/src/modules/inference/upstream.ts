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
import type { ResolvedModel } from "./models.ts";
import type { ChatBackend, ChatEvent, PreparedChat } from "./service.ts";

type ChatCompletionChunk = components["schemas"]["ChatCompletionChunk"];

/**
 * An OpenAI-compatible upstream (vLLM, SGLang, llama.cpp server, another Arbor). The request is
 * forwarded as sent, under the upstream's model name, and always streamed with its usage, so
 * that one path serves both kinds of request and the usage is always there to record. Its
 * refusals come back in our envelope; its own credentials or outages are our 503.
 */
export const upstreamChatBackend: ChatBackend<Extract<ResolvedModel, { kind: "upstream" }>> = {
  async prepare(resolved, body: ChatRequest): Promise<PreparedChat> {
    const { upstream } = resolved;
    const outgoing = {
      ...body,
      model: upstream.model ?? resolved.id,
      stream: true,
      stream_options: { include_usage: true },
    };
    return {
      promptTokens: 0,
      start: async (signal) => upstreamEvents(await postUpstream(upstream, outgoing, signal)),
    };
  },
};

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
      if (choice.finish_reason) {
        yield {
          type: "finish",
          choice: choice.index,
          content: "",
          finishReason: choice.finish_reason === "length" ? "length" : "stop",
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

/** Sends the chat request upstream. A refusal comes back as our envelope; the upstream's
 * own credentials or outages are our 503, never its internals. */
async function postUpstream(
  upstream: UpstreamConfig,
  body: Record<string, unknown>,
  signal: AbortSignal,
): Promise<Response> {
  let response: Response;
  try {
    response = await fetch(`${upstream.url.replace(/\/+$/, "")}/chat/completions`, {
      method: "POST",
      headers: {
        "content-type": "application/json",
        accept: body.stream ? "text/event-stream" : "application/json",
        ...(upstream.apiKey ? { authorization: `Bearer ${upstream.apiKey}` } : {}),
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
  if (response.ok) return response;
  const text = await response.text().catch(() => "");
  let message = text.slice(0, 500);
  try {
    const parsed = JSON.parse(text) as {
      error?: { message?: string };
      detail?: unknown;
      message?: string;
    };
    message =
      parsed.error?.message ??
      (typeof parsed.detail === "string" ? parsed.detail : undefined) ??
      parsed.message ??
      message;
  } catch {
    // not JSON: keep the text
  }
  const status = response.status;
  if (status === 401 || status === 403 || status >= 500) {
    throw unavailable(`the upstream for this model failed (${status}: ${message})`);
  }
  throw refusal(status, message || `upstream answered ${status}`, response.headers);
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

function unavailable(message: string): UnavailableError {
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
