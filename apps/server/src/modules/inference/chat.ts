import {
  type JsonSchema,
  parseJsonSchema,
  type ThreadGenerateRequest,
  type TokenLogprob,
  UnsupportedSchemaError,
} from "@arbor/engine/serve";
import type { components } from "@arbor/spec/schema";
import { InvalidInputError, quote } from "@arbor/store";

type Schemas = components["schemas"];
export type ChatRequest = Schemas["CreateChatCompletionRequest"];
type TokenLogprobs = NonNullable<
  NonNullable<Schemas["ChatCompletion"]["choices"][number]["logprobs"]>["content"]
>;

/** Fields the engine honours (ADR 11). Anything else that is set is refused with 400,
 * never silently ignored. */
const honoured = new Set([
  "model",
  "messages",
  "temperature",
  "top_p",
  "n",
  "max_tokens",
  "max_completion_tokens",
  "stop",
  "seed",
  "presence_penalty",
  "frequency_penalty",
  "logprobs",
  "top_logprobs",
  "response_format",
  "stream",
  "stream_options",
  "user",
]);

const messageFields = new Set(["role", "content", "tool_call_id"]);

/** The most choices one request may ask for. */
export const MAX_CHOICES = 8;

export function unsupported(
  param: string,
  why = "is not supported by this model",
): InvalidInputError {
  return new InvalidInputError(`\`${param}\` ${why}.`, { param, code: "unsupported_parameter" });
}

function invalid(message: string, param: string): InvalidInputError {
  return new InvalidInputError(message, { param });
}

/** Translates an OpenAI chat request into an engine request, refusing what it cannot honour. */
export function toGenerateRequest(body: ChatRequest): ThreadGenerateRequest {
  for (const [key, value] of Object.entries(body)) {
    if (value !== null && value !== undefined && !honoured.has(key))
      throw unsupported(key.length > 64 ? `${key.slice(0, 64)}…` : key);
  }
  const messages = body.messages.map((message, i) => {
    for (const [key, value] of Object.entries(message)) {
      if (value !== null && value !== undefined && !messageFields.has(key)) {
        throw unsupported(`messages[${i}].${key.length > 64 ? `${key.slice(0, 64)}…` : key}`);
      }
    }
    return { role: message.role, content: textOf(message.content, i) };
  });
  if (messages.length === 0) throw invalid("`messages` must not be empty.", "messages");
  const n = body.n ?? 1;
  if (n > MAX_CHOICES) throw invalid(`\`n\` may be at most ${MAX_CHOICES}.`, "n");
  if (body.stream_options && !body.stream) {
    throw invalid("`stream_options` is only allowed when `stream` is true.", "stream_options");
  }
  if (body.top_logprobs !== undefined && body.top_logprobs !== null && !body.logprobs) {
    throw invalid("`top_logprobs` needs `logprobs: true`.", "top_logprobs");
  }
  const maxTokens = body.max_completion_tokens ?? body.max_tokens ?? undefined;
  const stop = typeof body.stop === "string" ? [body.stop] : (body.stop ?? []);
  const request: ThreadGenerateRequest = {
    messages,
    n,
    stop,
    logprobs: body.logprobs ?? false,
    topLogprobs: body.top_logprobs ?? 0,
  };
  if (maxTokens !== undefined) request.maxTokens = maxTokens;
  if (body.temperature !== undefined && body.temperature !== null)
    request.temperature = body.temperature;
  if (body.top_p !== undefined && body.top_p !== null) request.topP = body.top_p;
  if (body.seed !== undefined && body.seed !== null) request.seed = body.seed;
  if (body.presence_penalty !== undefined && body.presence_penalty !== null)
    request.presencePenalty = body.presence_penalty;
  if (body.frequency_penalty !== undefined && body.frequency_penalty !== null)
    request.frequencyPenalty = body.frequency_penalty;
  const format = body.response_format;
  if (format && format.type === "json_object") request.responseFormat = { type: "json_object" };
  if (format && format.type === "json_schema") {
    request.responseFormat = {
      type: "json_schema",
      schema: jsonSchemaOf(format.json_schema.schema),
    };
  }
  return request;
}

/** The response schema as the engine honours it; a keyword it would ignore is a 400. */
function jsonSchemaOf(schema: Record<string, unknown> | undefined): JsonSchema {
  try {
    return parseJsonSchema(schema ?? {}, "response_format.json_schema.schema");
  } catch (err) {
    if (!(err instanceof UnsupportedSchemaError)) throw err;
    throw new InvalidInputError(`${err.message}: the engine cannot constrain decoding to it.`, {
      param: err.path,
      code: "unsupported_parameter",
    });
  }
}

function textOf(content: unknown, i: number): string {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    return content
      .map((part: { type?: string; text?: string }, j) => {
        if (part.type !== "text")
          throw unsupported(
            `messages[${i}].content[${j}].type`,
            `${quote(part.type)} is not supported; only text parts are`,
          );
        return part.text ?? "";
      })
      .join("");
  }
  throw invalid(`messages[${i}].content must be a string or text parts.`, `messages[${i}].content`);
}

/** OpenAI's per-token logprobs from the engine's. */
export function toLogprobs(tokens: TokenLogprob[]): TokenLogprobs {
  return tokens.map((t) => ({
    token: t.text,
    logprob: t.logprob,
    bytes: [...Buffer.from(t.text, "utf8")],
    top_logprobs: t.topLogprobs.map((alt) => ({
      token: alt.text,
      logprob: alt.logprob,
      bytes: [...Buffer.from(alt.text, "utf8")],
    })),
  }));
}
