import type { ToolCall } from "./chat.ts";
import { heldSuffix } from "./text.ts";

/**
 * How a chat template's model writes tool calls, read from the template's own text (ADR 60):
 *
 * - `hermes`: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block per call, after
 *   any text (Qwen2.5, Qwen3, QwQ, Hermes, tiny-chat): the template writes `<tool_call>`.
 * - `llama3-json`: the whole reply is `{"name": …, "parameters": {…}}` (Llama 3.1+, 3.2, 3.3 with
 *   JSON tool calling), several separated by `;`: the template writes `"parameters"` and
 *   Llama 3's `<|eot_id|>`.
 *
 * A template that writes neither has no tool calls the engine can read.
 */
export type ToolCallFormat = "hermes" | "llama3-json";

export function toolCallFormat(template: string): ToolCallFormat | null {
  if (template.includes("<tool_call>")) return "hermes";
  if (template.includes('"parameters"') && template.includes("<|eot_id|>")) return "llama3-json";
  return null;
}

/** A call as the model wrote it (the arguments as JSON text): it has no id yet. */
export type ParsedToolCall = Omit<ToolCall, "id">;

/** What a reply says: its text (empty when it only calls) and its calls. */
export interface ParsedReply {
  content: string;
  calls: ParsedToolCall[];
}

const HERMES_OPEN = "<tool_call>";
const HERMES_CALL = /<tool_call>([\s\S]*?)(?:<\/tool_call>|$)/g;
/** What Llama 3 may write before a call (when the tokenizer shows its special tokens). */
const PYTHON_TAG = "<|python_tag|>";

/**
 * The reply's tool calls in `format`, or null when it has none or they do not parse (a
 * malformed call is text, never an error).
 */
export function parseToolCalls(format: ToolCallFormat, text: string): ParsedReply | null {
  if (format === "hermes") {
    const start = text.indexOf(HERMES_OPEN);
    if (start < 0) return null;
    const calls: ParsedToolCall[] = [];
    for (const match of text.slice(start).matchAll(HERMES_CALL)) {
      const call = callOf(match[1]!, "arguments");
      if (!call) return null;
      calls.push(call);
    }
    return calls.length > 0 ? { content: text.slice(0, start).trim(), calls } : null;
  }
  const trimmed = text.trim();
  const body = trimmed.startsWith(PYTHON_TAG) ? trimmed.slice(PYTHON_TAG.length) : trimmed;
  if (!body.startsWith("{")) return null;
  const calls: ParsedToolCall[] = [];
  for (const part of splitTopLevel(body)) {
    const call = callOf(part, "parameters");
    if (!call) return null;
    calls.push(call);
  }
  return calls.length > 0 ? { content: "", calls } : null;
}

/** How a reply that calls tools begins, for a stream to hold back what may be one. */
export function toolCallStart(format: ToolCallFormat): string {
  return format === "hermes" ? HERMES_OPEN : "{";
}

/**
 * Where a call the model chooses to make opens, for constraining it (ADR 63): a hermes call at
 * each `<tool_call>`, wherever it is; a Llama 3 call at a `{` that starts the reply (after
 * blanks or `<|python_tag|>`) or follows a finished call and its `;`, the `{` being the
 * call's own start.
 */
export function callOpening(format: ToolCallFormat): {
  trigger: string;
  anchored?: { first: string[]; next: string[] };
  opensValue?: boolean;
} {
  if (format === "hermes") return { trigger: HERMES_OPEN };
  return { trigger: "{", anchored: { first: ["", PYTHON_TAG], next: [";"] }, opensValue: true };
}

/**
 * How much of a reply's `text` so far can be sent as text in `format`: all of it before what
 * may start a call. A hermes call may follow text, so only its opening (or a tail that may
 * begin one) is held; a Llama 3 reply is a call when it starts as one, so it is held until its
 * first character shows.
 */
export function sendableLength(format: ToolCallFormat, text: string): number {
  const start = toolCallStart(format);
  if (format === "llama3-json") {
    const opening = text.trimStart();
    const body = opening.startsWith(PYTHON_TAG) ? opening.slice(PYTHON_TAG.length) : opening;
    return body.length === 0 || body.startsWith(start) || PYTHON_TAG.startsWith(opening)
      ? 0
      : text.length;
  }
  const at = text.indexOf(start);
  return at >= 0 ? at : text.length - heldSuffix(text, start);
}

/**
 * The text a constrained call is generated after (added to the prompt), and the JSON schema of
 * what follows it: `{"name": <a candidate's name>, "<arguments>": <that candidate's schema>}`.
 * Several candidates make a `oneOf` told apart by `name` (which the JSON constraint writes
 * first), so the arguments always follow the schema of the function named.
 */
export function constrainedCall(
  format: ToolCallFormat,
  candidates: readonly { name: string; parameters: Record<string, unknown> }[],
): { prefill: string; schema: Record<string, unknown> } {
  const key = format === "hermes" ? "arguments" : "parameters";
  const call = (names: string[], parameters: Record<string, unknown>) => ({
    type: "object",
    properties: { name: { type: "string", enum: names }, [key]: parameters },
    required: ["name", key],
  });
  const only = candidates.length === 1 ? candidates[0] : undefined;
  return {
    prefill: format === "hermes" ? `${HERMES_OPEN}\n` : "",
    schema: only
      ? call([only.name], only.parameters)
      : { oneOf: candidates.map(({ name, parameters }) => call([name], parameters)) },
  };
}

/** One call's JSON (`{"name", <key>}`; `arguments` is accepted for either), or null. */
function callOf(json: string, key: string): ParsedToolCall | null {
  let value: unknown;
  try {
    value = JSON.parse(json.trim());
  } catch {
    return null;
  }
  if (typeof value !== "object" || value === null || Array.isArray(value)) return null;
  const { name, ...rest } = value as Record<string, unknown>;
  const args = rest[key] ?? rest["arguments"] ?? {};
  if (typeof name !== "string" || name.length === 0) return null;
  if (typeof args === "string") return { name, arguments: args };
  if (typeof args !== "object" || args === null || Array.isArray(args)) return null;
  return { name, arguments: JSON.stringify(args) };
}

/** `a; b` split at the `;` between top-level JSON values (not inside strings or brackets). */
function splitTopLevel(text: string): string[] {
  const parts: string[] = [];
  let depth = 0;
  let inString = false;
  let start = 0;
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (inString) {
      if (c === "\\") i++;
      else if (c === '"') inString = false;
    } else if (c === '"') inString = true;
    else if (c === "{" || c === "[") depth++;
    else if (c === "}" || c === "]") depth--;
    else if (c === ";" && depth === 0) {
      parts.push(text.slice(start, i));
      start = i + 1;
    }
  }
  parts.push(text.slice(start));
  return parts.filter((p) => p.trim().length > 0);
}
