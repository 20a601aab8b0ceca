import type { ChatMessage, ChatRole, ToolCall } from "../model/chat.ts";

/** Bad training input (SFT lines, trajectory groups); the message names where. */
export class TrainingInputError extends Error {
  override readonly name: string = "TrainingInputError";
}

const roles: readonly ChatRole[] = ["system", "developer", "user", "assistant", "tool"];

/**
 * An OpenAI-style chat message (`content` string, parts array or null; `tool_calls` with
 * `function.{name, arguments}`; `tool_call_id`), or the engine's own `ChatMessage`, as a
 * `ChatMessage`. Throws `TrainingInputError` naming `where`.
 */
export function toChatMessage(raw: unknown, where: string): ChatMessage {
  if (typeof raw !== "object" || raw === null) {
    throw new TrainingInputError(`${where}: a message must be an object`);
  }
  const m = raw as Record<string, unknown>;
  const role = m["role"];
  if (typeof role !== "string" || !roles.includes(role as ChatRole)) {
    throw new TrainingInputError(`${where}: unknown role ${JSON.stringify(role)}`);
  }
  const content = contentText(m["content"], where);
  const message: ChatMessage = { role: role as ChatRole, content };
  const calls = m["tool_calls"] ?? m["toolCalls"];
  if (Array.isArray(calls) && calls.length > 0) {
    message.toolCalls = calls.map((c, i): ToolCall => {
      const call = (c ?? {}) as Record<string, unknown>;
      const fn = (call["function"] ?? call) as Record<string, unknown>;
      const name = fn["name"];
      if (typeof name !== "string") {
        throw new TrainingInputError(`${where}: tool call ${i} has no function name`);
      }
      const args = fn["arguments"];
      return {
        ...(typeof call["id"] === "string" ? { id: call["id"] } : {}),
        name,
        arguments: typeof args === "string" ? args : JSON.stringify(args ?? {}),
      };
    });
  }
  const callId = m["tool_call_id"] ?? m["toolCallId"];
  if (typeof callId === "string") message.toolCallId = callId;
  return message;
}

function contentText(content: unknown, where: string): string {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    return content
      .map((part) => {
        const p = part as Record<string, unknown> | null;
        if (p && p["type"] === "text" && typeof p["text"] === "string") return p["text"];
        throw new TrainingInputError(`${where}: only text content parts are supported`);
      })
      .join("");
  }
  throw new TrainingInputError(`${where}: content must be a string, an array of parts or null`);
}
