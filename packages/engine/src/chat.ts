import type { Tokenizer } from "./tokenizer.ts";

export type ChatRole = "system" | "developer" | "user" | "assistant" | "tool";

export interface ToolCall {
  id?: string;
  name: string;
  arguments: string;
}

export interface ChatMessage {
  role: ChatRole;
  content: string;
  /** Assistant messages may carry tool calls, rendered Qwen-style inside `<tool_call>` tags. */
  toolCalls?: ToolCall[];
  /** Tool results may name the call they answer. */
  toolCallId?: string;
}

export interface RenderedChat {
  text: string;
  tokens: number[];
  /** 1 where the token is assistant output the model should learn (content and `<|im_end|>`). */
  assistantMask: Uint8Array;
}

export const IM_START = "<|im_start|>";
export const IM_END = "<|im_end|>";
export const END_OF_TEXT = "<|endoftext|>";

/** The same ChatML as a Jinja chat template, for tokenizer_config.json and GGUF (no tool calls). */
export const CHATML_TEMPLATE =
  "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/**
 * Renders ChatML:
 * `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then `<|im_start|>assistant\n` when a
 * generation prompt is asked for. Each piece is tokenized on its own, so the assistant mask is exact.
 */
export function renderChat(
  tokenizer: Tokenizer,
  messages: readonly ChatMessage[],
  options: { addGenerationPrompt?: boolean } = {},
): RenderedChat {
  const tokens: number[] = [];
  const mask: number[] = [];
  let text = "";
  const push = (piece: string, assistant: boolean, special = false) => {
    if (piece.length === 0) return;
    text += piece;
    const ids = special
      ? [specialId(tokenizer, piece)]
      : tokenizer.encode(piece, { allowSpecial: false });
    for (const id of ids) {
      tokens.push(id);
      mask.push(assistant ? 1 : 0);
    }
  };
  for (const message of messages) {
    const assistant = message.role === "assistant";
    push(IM_START, false, true);
    push(`${message.role}\n`, false);
    push(messageBody(message), assistant);
    push(IM_END, assistant, true);
    push("\n", false);
  }
  if (options.addGenerationPrompt) {
    push(IM_START, false, true);
    push("assistant\n", false);
  }
  return { text, tokens, assistantMask: Uint8Array.from(mask) };
}

function messageBody(message: ChatMessage): string {
  let body = message.content;
  for (const call of message.toolCalls ?? []) {
    const args = safeParse(call.arguments);
    body += `${body ? "\n" : ""}<tool_call>\n${JSON.stringify({ name: call.name, arguments: args })}\n</tool_call>`;
  }
  return body;
}

function safeParse(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

function specialId(tokenizer: Tokenizer, content: string): number {
  const id = tokenizer.tokenId(content);
  if (id === undefined) throw new Error(`tokenizer has no ${content} token`);
  return id;
}
