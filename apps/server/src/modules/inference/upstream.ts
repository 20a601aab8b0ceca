import type { components } from "@arbor/spec/schema";
import { EventSourceParserStream } from "eventsource-parser/stream";
import { ApiError } from "../../http/errors.ts";

type Schemas = components["schemas"];
type ChatCompletion = Schemas["ChatCompletion"];
type ChatCompletionChunk = Schemas["ChatCompletionChunk"];
type Usage = Schemas["CompletionUsage"];

import type { UpstreamConfig } from "@arbor/config";

/** Sends the chat request upstream. A refusal comes back as our envelope; the upstream's
 * own credentials or outages are our 503, never its internals. */
export async function postUpstream(
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
  if (status === 429) {
    throw new ApiError(429, `The upstream is rate limiting: ${message}`, {
      code: "rate_limit_exceeded",
      headers: { "retry-after": response.headers.get("retry-after") ?? "1" },
    });
  }
  return Promise.reject(
    new ApiError(status, message || `upstream answered ${status}`, {
      code: status === 404 ? "model_not_found" : null,
    }),
  );
}

function unavailable(message: string): ApiError {
  return new ApiError(503, `Service unavailable: ${message}.`, {
    headers: { "retry-after": "5", "x-should-retry": "true" },
  });
}

/** Our shape from an upstream's completion: known fields only, our model id. */
export function sanitizeCompletion(raw: ChatCompletion, model: string): ChatCompletion {
  return {
    id: raw.id,
    object: "chat.completion",
    created: raw.created,
    model,
    system_fingerprint: raw.system_fingerprint ?? "fp_upstream",
    choices: raw.choices.map((c) => ({
      index: c.index,
      message: { role: "assistant", content: c.message?.content ?? "", refusal: null },
      finish_reason: c.finish_reason === "length" ? "length" : "stop",
      logprobs: c.logprobs ?? null,
    })),
    usage: usageOf(raw.usage),
  };
}

export function sanitizeChunk(raw: ChatCompletionChunk, model: string): ChatCompletionChunk {
  return {
    id: raw.id,
    object: "chat.completion.chunk",
    created: raw.created,
    model,
    system_fingerprint: raw.system_fingerprint ?? "fp_upstream",
    choices: (raw.choices ?? []).map((c) => ({
      index: c.index,
      delta: {
        ...(c.delta?.role ? { role: "assistant" as const } : {}),
        ...(c.delta?.content !== undefined ? { content: c.delta.content } : {}),
      },
      finish_reason:
        c.finish_reason === null || c.finish_reason === undefined
          ? null
          : c.finish_reason === "length"
            ? "length"
            : "stop",
      ...(c.logprobs ? { logprobs: c.logprobs } : {}),
    })),
    ...(raw.usage ? { usage: usageOf(raw.usage) } : {}),
  };
}

function usageOf(usage: Partial<Usage> | null | undefined): Usage {
  const prompt = usage?.prompt_tokens ?? 0;
  const completion = usage?.completion_tokens ?? 0;
  return {
    prompt_tokens: prompt,
    completion_tokens: completion,
    total_tokens: usage?.total_tokens ?? prompt + completion,
  };
}

/** The chunks of an upstream SSE response, until `[DONE]`; an error event is thrown. */
export async function* upstreamChunks(response: Response): AsyncGenerator<ChatCompletionChunk> {
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
