import { type ChatMessage, type ChatRole, renderChat, type ToolCall } from "./chat.ts";
import type { Tokenizer } from "./tokenizer.ts";

/** Bad training input (SFT lines, trajectory groups); the message names where. */
export class TrainingInputError extends Error {
  override readonly name = "TrainingInputError";
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

/**
 * Tool definitions (OpenAI `tools`) rendered Qwen-style into the system prompt: appended to the
 * first system message, or as a new leading one. Use the same for training and inference.
 */
export function withTools(
  messages: readonly ChatMessage[],
  tools: readonly unknown[] | undefined,
): ChatMessage[] {
  if (!tools || tools.length === 0) return [...messages];
  const block = `# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>\n${tools
    .map((t) => JSON.stringify(t))
    .join("\n")}\n</tools>`;
  const first = messages[0];
  if (first?.role === "system") {
    return [{ ...first, content: `${first.content}\n\n${block}` }, ...messages.slice(1)];
  }
  return [{ role: "system", content: block }, ...messages];
}

export interface TokenizedChat {
  tokens: number[];
  /** Per token: 1 where it is trained (a selected assistant turn's content and `<|im_end|>`). */
  mask: Uint8Array;
  /** Per message: its token range [start, end). */
  ranges: [number, number][];
}

/**
 * Tokenizes a conversation exactly as `renderChat` does (its pieces are tokenized one by one, so
 * rendering message by message gives the same tokens) and keeps the assistant mask only on the
 * messages `trainable(i)` selects.
 */
export function tokenizeChat(
  tokenizer: Tokenizer,
  messages: readonly ChatMessage[],
  trainable: (index: number) => boolean,
): TokenizedChat {
  const tokens: number[] = [];
  const mask: number[] = [];
  const ranges: [number, number][] = [];
  messages.forEach((message, i) => {
    const r = renderChat(tokenizer, [message]);
    const start = tokens.length;
    const keep = message.role === "assistant" && trainable(i);
    r.tokens.forEach((t, j) => {
      tokens.push(t);
      mask.push(keep ? r.assistantMask[j]! : 0);
    });
    ranges.push([start, tokens.length]);
  });
  return { tokens, mask: Uint8Array.from(mask), ranges };
}
