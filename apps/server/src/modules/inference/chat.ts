import type { ChatMessage } from "@arbor/engine/model";
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
export type ChatTool = Schemas["ChatCompletionTool"];
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
  "tools",
  "tool_choice",
  "parallel_tool_calls",
  // OpenAI's bookkeeping: they change nothing in what is generated (ADR 65). `metadata`,
  // `user` and `safety_identifier` are recorded on the call.
  "store",
  "metadata",
  "service_tier",
  "prompt_cache_key",
  "safety_identifier",
  // Checked below: only what the models do anyway.
  "verbosity",
  "reasoning_effort",
]);

const messageFields = new Set(["role", "content", "name", "tool_call_id", "tool_calls"]);

/** What a content part that is not text is, for the refusal. */
const PART_KINDS: Record<string, string> = {
  image_url: "Images are",
  input_image: "Images are",
  input_audio: "Audio is",
  file: "Files are",
  input_file: "Files are",
};

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
  // The engine's models have neither setting: they take what they do anyway.
  if (body.verbosity && body.verbosity !== "medium") {
    throw unsupported(
      "verbosity",
      `${quote(body.verbosity)} is not supported by this model, which has no verbosity setting (send "medium", OpenAI's default, or leave it out)`,
    );
  }
  if (body.reasoning_effort && body.reasoning_effort !== "none") {
    throw unsupported(
      "reasoning_effort",
      `${quote(body.reasoning_effort)} is not supported by this model, which has no reasoning-effort setting (send "none", or leave it out)`,
    );
  }
  const messages = body.messages.map((message, i) => {
    for (const [key, value] of Object.entries(message)) {
      if (value !== null && value !== undefined && !messageFields.has(key)) {
        throw unsupported(`messages[${i}].${key.length > 64 ? `${key.slice(0, 64)}…` : key}`);
      }
    }
    const out: ChatMessage = { role: message.role, content: textOf(message.content, i) };
    const calls = (message as { tool_calls?: unknown }).tool_calls;
    if (message.role !== "assistant" && calls !== null && calls !== undefined) {
      throw unsupported(`messages[${i}].tool_calls`, "is supported on assistant messages only");
    }
    if ("tool_calls" in message && message.tool_calls && message.tool_calls.length > 0) {
      out.toolCalls = message.tool_calls.map((call) => ({
        id: call.id,
        name: call.function.name,
        arguments: call.function.arguments,
      }));
    }
    if ("tool_call_id" in message) out.toolCallId = message.tool_call_id;
    if ("name" in message && message.name) out.name = message.name;
    return out;
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

/** What a request asks of tools: which it offers, which call it requires (a name, any of
 * them, or none), and whether one turn may make several calls. */
export interface ToolRequest {
  tools: ChatTool[];
  choice: "none" | "auto" | "required" | { name: string };
  parallel: boolean;
}

/** The request's tools, checked: a `tool_choice` without tools, or naming a function `tools`
 * does not declare, is a 400 naming `tool_choice`; a name declared twice, one naming `tools`. */
export function toolRequestOf(body: ChatRequest): ToolRequest | null {
  const tools = body.tools ?? [];
  const choice = body.tool_choice ?? "auto";
  if (tools.length === 0) {
    if (body.tool_choice && body.tool_choice !== "none") {
      throw invalid("`tool_choice` is only allowed when `tools` are given.", "tool_choice");
    }
    return null;
  }
  const names = new Set<string>();
  tools.forEach((tool, i) => {
    if (names.has(tool.function.name)) {
      throw invalid(
        `\`tools\` declares the function ${quote(tool.function.name)} twice.`,
        `tools[${i}].function.name`,
      );
    }
    names.add(tool.function.name);
  });
  if (typeof choice === "object" && !names.has(choice.function.name)) {
    throw invalid(
      `\`tool_choice\` names the function ${quote(choice.function.name)}, which \`tools\` does not declare.`,
      "tool_choice",
    );
  }
  return {
    tools,
    choice: typeof choice === "object" ? { name: choice.function.name } : choice,
    parallel: body.parallel_tool_calls ?? true,
  };
}

/** The response schema as the engine honours it; a keyword it would ignore is a 400. */
export function jsonSchemaOf(
  schema: Record<string, unknown> | undefined,
  path = "response_format.json_schema.schema",
): JsonSchema {
  try {
    return parseJsonSchema(schema ?? {}, path);
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
      .map((part: { type?: string; text?: unknown }, j) => {
        const at = `messages[${i}].content[${j}]`;
        if (part.type !== "text") {
          const kind = PART_KINDS[part.type ?? ""];
          throw new InvalidInputError(
            kind
              ? `${kind} not supported: this model reads text only (\`${at}\` is an \`${part.type}\` part). Send the content as text parts.`
              : `\`${at}.type\` ${quote(part.type)} is not supported: this model reads text parts only.`,
            { param: kind ? at : `${at}.type`, code: "unsupported_content" },
          );
        }
        if (typeof part.text !== "string")
          throw invalid(`\`${at}.text\` is required on a text part.`, `${at}.text`);
        return part.text;
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
