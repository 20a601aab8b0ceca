import type { components } from "@arbor/spec/schema";
import { InvalidInputError, quote } from "@arbor/store";
import { type ChatRequest, unsupported } from "./chat.ts";

/**
 * OpenAI's Responses API, stateless, over the chat path (ADR 65): a request becomes a chat
 * request, and the chat's completion or chunks become a Response or its events.
 */
type Schemas = components["schemas"];
export type ResponseRequest = Schemas["CreateResponseRequest"];
export type ResponseObject = Schemas["Response"];
export type ResponseStreamEvent = Schemas["ResponseStreamEvent"];
type ChatCompletion = Schemas["ChatCompletion"];
type ChatCompletionChunk = Schemas["ChatCompletionChunk"];
type Usage = NonNullable<ChatCompletion["usage"]>;

/** Fields a stateless server over the chat path honours; any other that is set is a 400. */
const honoured = new Set([
  "model",
  "input",
  "instructions",
  "max_output_tokens",
  "temperature",
  "top_p",
  "stream",
  "text",
  "reasoning",
  "store",
  "metadata",
  "user",
  "safety_identifier",
  "prompt_cache_key",
  "service_tier",
  "parallel_tool_calls",
  "previous_response_id",
  "tools",
]);

const PART_KINDS: Record<string, string> = {
  input_image: "Images are",
  input_audio: "Audio is",
  input_file: "Files are",
};

/** The chat request a Responses request runs as; what it cannot honour is refused here. */
export function chatRequestOf(body: ResponseRequest): ChatRequest {
  for (const [key, value] of Object.entries(body)) {
    if (value !== null && value !== undefined && !honoured.has(key))
      throw unsupported(
        key.length > 64 ? `${key.slice(0, 64)}…` : key,
        "is not supported on /v1/responses",
      );
  }
  if (body.previous_response_id) {
    throw unsupported(
      "previous_response_id",
      "is not supported: Arbor's responses are stateless and none is kept to continue from (send the whole conversation in `input`)",
    );
  }
  if (body.tools && body.tools.length > 0) {
    throw unsupported(
      "tools",
      "are not served on /v1/responses yet: use /v1/chat/completions for tool calling",
    );
  }
  if (body.reasoning?.summary) {
    throw unsupported(
      "reasoning.summary",
      "is not supported: the models write no reasoning summary",
    );
  }
  const messages: ChatRequest["messages"] = [];
  if (body.instructions) messages.push({ role: "system", content: body.instructions });
  if (typeof body.input === "string") messages.push({ role: "user", content: body.input });
  else
    body.input.forEach((item, i) => {
      messages.push({
        role: item.role,
        content: textOf(item.content, i),
      } as ChatRequest["messages"][number]);
    });
  const format = body.text?.format;
  const chat: ChatRequest = {
    model: body.model,
    messages,
    ...defined({
      max_completion_tokens: body.max_output_tokens,
      temperature: body.temperature,
      top_p: body.top_p,
      store: body.store,
      metadata: body.metadata,
      user: body.user,
      safety_identifier: body.safety_identifier,
      prompt_cache_key: body.prompt_cache_key,
      service_tier: body.service_tier,
      parallel_tool_calls: body.parallel_tool_calls,
      verbosity: body.text?.verbosity,
      reasoning_effort: body.reasoning?.effort,
    }),
  };
  if (format?.type === "json_object") chat.response_format = { type: "json_object" };
  if (format?.type === "json_schema") {
    chat.response_format = {
      type: "json_schema",
      json_schema: {
        name: format.name,
        schema: format.schema,
        ...(format.strict !== undefined && format.strict !== null ? { strict: format.strict } : {}),
        ...(format.description ? { description: format.description } : {}),
      },
    };
  }
  if (body.stream) {
    chat.stream = true;
    chat.stream_options = { include_usage: true };
  }
  return chat;
}

function textOf(content: Schemas["ResponseInputMessage"]["content"], i: number): string {
  if (typeof content === "string") return content;
  return content
    .map((part, j) => {
      const at = `input[${i}].content[${j}]`;
      if (part.type !== "input_text" && part.type !== "output_text") {
        const kind = PART_KINDS[part.type];
        throw new InvalidInputError(
          kind
            ? `${kind} not supported: this model reads text only (\`${at}\` is an \`${part.type}\` part). Send the content as input_text parts.`
            : `\`${at}.type\` ${quote(part.type)} is not supported: send input_text parts.`,
          { param: kind ? at : `${at}.type`, code: "unsupported_content" },
        );
      }
      if (typeof part.text !== "string")
        throw new InvalidInputError(`\`${at}.text\` is required on a text part.`, {
          param: `${at}.text`,
        });
      return part.text;
    })
    .join("");
}

function defined<T extends Record<string, unknown>>(
  object: T,
): Partial<{ [K in keyof T]: NonNullable<T[K]> }> {
  return Object.fromEntries(
    Object.entries(object).filter(([, v]) => v !== undefined && v !== null),
  ) as never;
}

/** `resp_…` and `msg_…` from the chat's id (`chatcmpl-<uuid>`), so they name the recorded run. */
function idsOf(chatId: string): { response: string; message: string } {
  const hex = chatId.replace(/^chatcmpl-/, "").replaceAll("-", "");
  return { response: `resp_${hex}`, message: `msg_${hex}` };
}

/** The Response's fields that echo the request. */
function echoed(body: ResponseRequest) {
  const format = body.text?.format ?? { type: "text" as const };
  return {
    instructions: body.instructions ?? null,
    max_output_tokens: body.max_output_tokens ?? null,
    temperature: body.temperature ?? null,
    top_p: body.top_p ?? null,
    parallel_tool_calls: body.parallel_tool_calls ?? true,
    tool_choice: "auto" as const,
    tools: [],
    text: { format },
    metadata: body.metadata ?? {},
    store: false as const,
  };
}

function usageOf(usage: Usage | null | undefined): ResponseObject["usage"] {
  if (!usage) return null;
  return {
    input_tokens: usage.prompt_tokens,
    input_tokens_details: { cached_tokens: 0 },
    output_tokens: usage.completion_tokens,
    output_tokens_details: { reasoning_tokens: 0 },
    total_tokens: usage.total_tokens,
  };
}

function response(
  body: ResponseRequest,
  chat: { id: string; created: number; model: string },
  state: { status: ResponseObject["status"]; text?: string; usage?: Usage | null },
): ResponseObject {
  const ids = idsOf(chat.id);
  return {
    id: ids.response,
    object: "response",
    created_at: chat.created,
    status: state.status,
    model: chat.model,
    output:
      state.text === undefined
        ? []
        : [
            {
              type: "message",
              id: ids.message,
              status: state.status,
              role: "assistant",
              content: [{ type: "output_text", text: state.text, annotations: [] }],
            },
          ],
    usage: usageOf(state.usage),
    error: null,
    incomplete_details: state.status === "incomplete" ? { reason: "max_output_tokens" } : null,
    ...echoed(body),
  };
}

/** The Response of a whole chat completion. */
export function responseOf(body: ResponseRequest, completion: ChatCompletion): ResponseObject {
  const choice = completion.choices[0];
  return response(body, completion, {
    status: choice?.finish_reason === "length" ? "incomplete" : "completed",
    text: choice?.message.content ?? "",
    usage: completion.usage,
  });
}

/** The Responses events of a streamed chat (asked for with its usage), in OpenAI's order. */
export async function* responseEvents(
  body: ResponseRequest,
  chat: { id: string; created: number; model: string },
  chunks: AsyncIterable<ChatCompletionChunk>,
): AsyncGenerator<ResponseStreamEvent> {
  let sequence = 0;
  const event = (e: Omit<ResponseStreamEvent, "sequence_number">): ResponseStreamEvent => ({
    ...e,
    sequence_number: sequence++,
  });
  const item_id = idsOf(chat.id).message;
  const at = { output_index: 0, content_index: 0 };
  const started = response(body, chat, { status: "in_progress" });
  yield event({ type: "response.created", response: started });
  yield event({ type: "response.in_progress", response: started });
  yield event({
    type: "response.output_item.added",
    output_index: 0,
    item: { type: "message", id: item_id, status: "in_progress", role: "assistant", content: [] },
  });
  const emptyPart = { type: "output_text" as const, text: "", annotations: [] };
  yield event({ type: "response.content_part.added", item_id, ...at, part: emptyPart });
  let text = "";
  let usage: Usage | null = null;
  let finish: string | null = null;
  for await (const chunk of chunks) {
    if (chunk.usage) usage = chunk.usage;
    const choice = chunk.choices[0];
    if (!choice) continue;
    if (choice.finish_reason) finish = choice.finish_reason;
    const delta = choice.delta.content;
    if (delta) {
      text += delta;
      yield event({ type: "response.output_text.delta", item_id, ...at, delta, logprobs: [] });
    }
  }
  const status = finish === "length" ? "incomplete" : "completed";
  const part = { type: "output_text" as const, text, annotations: [] };
  yield event({ type: "response.output_text.done", item_id, ...at, text, logprobs: [] });
  yield event({ type: "response.content_part.done", item_id, ...at, part });
  yield event({
    type: "response.output_item.done",
    output_index: 0,
    item: { type: "message", id: item_id, status, role: "assistant", content: [part] },
  });
  yield event({
    type: status === "completed" ? "response.completed" : "response.incomplete",
    response: response(body, chat, { status, text, usage }),
  });
}
