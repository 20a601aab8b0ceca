import { randomBytes } from "node:crypto";
import {
  callOpening,
  constrainedCall,
  parseToolCalls,
  sendableLength,
  type ToolCallFormat,
} from "@arbor/engine/model";
import {
  type ChatPromptOptions,
  type JsonSchema,
  parseJsonSchema,
  type ToolCallConstraint,
} from "@arbor/engine/serve";
import { InvalidInputError } from "@arbor/store";
import { type ChatTool, jsonSchemaOf, type ToolRequest, unsupported } from "./chat.ts";
import type { ChatEvent } from "./service.ts";

/** How the engine serves a request's tools. */
export interface EngineTools {
  /** What the prompt is rendered with: the tools, and the opening of a required call. */
  prompt: ChatPromptOptions;
  /** The JSON constraint of a required call (`tool_choice` `required` or a named function). */
  schema: JsonSchema | null;
  /** The constraint of the calls the model chooses to make (`auto` with `strict` functions). */
  toolCalls: ToolCallConstraint | null;
  /** How the replies are read for calls; null when they are not (`tool_choice: none`). */
  reading: ToolReading | null;
}

export interface ToolReading {
  format: ToolCallFormat;
  /** The reply's start that the prompt wrote (it is part of what is parsed). */
  prefill: string;
  parallel: boolean;
}

/**
 * The engine's plan for a request's tools in its template's `format` (ADR 60). A template
 * without tool calls refuses tools; `required` and a named function prefill the call's opening
 * and constrain what follows to `{"name": …, "arguments": <the function's parameters>}` (any
 * object when several functions may be called); a `strict` function's schema must be one the
 * engine can enforce (400 naming the keyword), another's falls back to any object.
 */
export function engineTools(
  format: ToolCallFormat | null,
  request: ToolRequest | null,
  responseFormat: unknown,
): EngineTools {
  const none = { schema: null, toolCalls: null, reading: null };
  if (!request) return { prompt: {}, ...none };
  if (!format) throw unsupported("tools");
  // Each function's arguments schema, parsed once: a strict one the engine cannot enforce is a
  // 400 whatever the choice.
  const functions = request.tools.map((tool, i) => ({ tool, schema: argumentsSchema(tool, i) }));
  const prompt: ChatPromptOptions = { tools: request.tools };
  const { choice } = request;
  if (choice === "none") return { prompt, ...none };
  if (choice === "auto") {
    const strict = request.tools.some((tool) => tool.function.strict);
    const call = strict ? callSchema(format, functions) : null;
    return {
      prompt,
      schema: null,
      toolCalls: call ? { ...callOpening(format), schema: call.schema } : null,
      reading: { format, prefill: "", parallel: request.parallel },
    };
  }
  if (responseFormat) {
    throw new InvalidInputError(
      "`response_format` cannot be combined with a required tool call: the call is the reply's format.",
      { param: "response_format" },
    );
  }
  const call = callSchema(
    format,
    choice === "required"
      ? functions
      : functions.filter(({ tool }) => tool.function.name === choice.name),
  );
  return {
    prompt: { ...prompt, prefill: call.prefill },
    schema: call.schema,
    toolCalls: null,
    reading: { format, prefill: call.prefill, parallel: false },
  };
}

/** The constraint of a call to one of `candidates`: its name, and the arguments' schema of the
 * function it names. */
function callSchema(
  format: ToolCallFormat,
  candidates: { tool: ChatTool; schema: JsonSchema }[],
): { prefill: string; schema: JsonSchema } {
  const call = constrainedCall(
    format,
    candidates.map(({ tool, schema }) => ({
      name: tool.function.name,
      parameters: schema as Record<string, unknown>,
    })),
  );
  // Made of schemas the engine enforces, told apart by the name: it always parses.
  return { prefill: call.prefill, schema: parseJsonSchema(call.schema) };
}

/** A function's arguments schema as the engine enforces it; a strict one it cannot is a 400. */
function argumentsSchema(tool: ChatTool, i: number): JsonSchema {
  const parameters = tool.function.parameters ?? { type: "object" };
  if (tool.function.strict) return jsonSchemaOf(parameters, `tools[${i}].function.parameters`);
  try {
    return parseJsonSchema(parameters);
  } catch {
    return { type: "object" };
  }
}

/** A new tool call's id, as OpenAI's look. */
function toolCallId(): string {
  return `call_${randomBytes(12).toString("base64url")}`;
}

/**
 * A choice's events with its tool calls read out of its text: text is streamed until it may be
 * the start of a call, which is held back to the end of the choice; there, calls that parse are
 * sent as OpenAI streams them (the id, type and name, then the arguments) and the choice ends
 * with `tool_calls`; a reply that does not parse is sent as the text it is.
 */
export async function* readToolCalls(
  events: AsyncIterable<ChatEvent>,
  reading: ToolReading,
): AsyncGenerator<ChatEvent> {
  const texts = new Map<number, { text: string; sent: number }>();
  for await (const event of events) {
    if (event.type !== "delta" && event.type !== "finish") {
      yield event;
      continue;
    }
    const state = texts.get(event.choice) ?? { text: "", sent: 0 };
    texts.set(event.choice, state);
    state.text += event.content;
    if (event.type === "delta") {
      // A prefilled call's opening makes the whole reply the call's.
      const upTo = reading.prefill.length > 0 ? 0 : sendableLength(reading.format, state.text);
      const content = state.text.slice(state.sent, Math.max(state.sent, upTo));
      state.sent = Math.max(state.sent, upTo);
      yield { ...event, content, ...(content.length < event.content.length ? { held: true } : {}) };
      continue;
    }
    const parsed = parseToolCalls(reading.format, reading.prefill + state.text);
    if (!parsed) {
      // Held text goes out as text (with the prefilled opening, when the prompt wrote one).
      yield { ...event, content: (reading.prefill + state.text).slice(state.sent) };
      continue;
    }
    const calls = reading.parallel ? parsed.calls : parsed.calls.slice(0, 1);
    for (const [index, call] of calls.entries()) {
      yield {
        type: "tool_call",
        choice: event.choice,
        delta: {
          index,
          id: toolCallId(),
          type: "function",
          function: { name: call.name, arguments: "" },
        },
      };
      yield {
        type: "tool_call",
        choice: event.choice,
        delta: { index, function: { arguments: call.arguments } },
      };
    }
    yield {
      type: "finish",
      choice: event.choice,
      content: "",
      finishReason: event.finishReason === "length" ? "length" : "tool_calls",
    };
  }
}
