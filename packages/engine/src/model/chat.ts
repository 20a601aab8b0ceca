import { Template } from "@huggingface/jinja";
import type { GenerationConfig } from "./config.ts";
import "./jinja-python.ts";
import { ModelFileError, Tokenizer, type TokenizerFiles, TokenLimitError } from "./tokenizer.ts";

export type ChatRole = "system" | "developer" | "user" | "assistant" | "tool";

export interface ToolCall {
  id?: string;
  name: string;
  /** The arguments as a JSON string, as OpenAI sends them. */
  arguments: string;
}

export interface ChatMessage {
  role: ChatRole;
  content: string;
  /** An assistant turn's tool calls. */
  toolCalls?: ToolCall[];
  /** A tool message's answer to a call. */
  toolCallId?: string;
  /** The participant's name (OpenAI's `name`), for templates that write it. */
  name?: string;
}

/** What a chat is rendered with besides its messages. */
export interface RenderOptions {
  /** End with the template's opening of an assistant turn. */
  addGenerationPrompt?: boolean;
  /** Tool definitions (OpenAI's `tools`), for templates that render them. */
  tools?: readonly Record<string, unknown>[] | undefined;
  /** Stop tokenizing with TokenLimitError once the prompt takes this many tokens. */
  limit?: number | undefined;
  /** Text of the reply written in advance, after the generation prompt (the opening of a tool
   * call the reply is constrained to); it is ours, so its special tokens' texts are tokens. */
  prefill?: string | undefined;
}

/** A conversation the template cannot render (it raised, or refused a role); the message says
 * why in the template's words. */
export class PromptError extends Error {
  override readonly name = "PromptError";
}

/**
 * A model's own chat template (`chat_template` of `tokenizer_config.json`, or
 * `chat_template.jinja` beside it), rendered with `@huggingface/jinja` as `transformers` renders
 * it with Jinja2: the messages, `add_generation_prompt`, `tools`, and the special tokens' texts
 * (`bos_token`, `eos_token`…) that templates expect.
 */
export class ChatTemplate {
  readonly source: string;
  readonly #template: Template;
  readonly #variables: Record<string, string>;
  /** Templates that know no `developer` role get it as `system`, as OpenAI defines it. */
  readonly #developerAsSystem: boolean;
  /** Templates that read the tools as `xml_tools` (SmolLM3's) get them so too. */
  readonly #xmlTools: boolean;

  constructor(source: string, variables: Record<string, string>, file: string) {
    this.source = source;
    try {
      this.#template = new Template(source);
    } catch (err) {
      throw new ModelFileError(file, `the chat template does not parse: ${(err as Error).message}`);
    }
    this.#variables = variables;
    this.#developerAsSystem = !source.includes("developer");
    this.#xmlTools = source.includes("xml_tools");
  }

  render(messages: readonly ChatMessage[], options: RenderOptions = {}): string {
    try {
      return this.#template.render({
        ...this.#variables,
        messages: messages.map((m) => this.#templateMessage(m)),
        add_generation_prompt: options.addGenerationPrompt ?? false,
        ...(options.tools && options.tools.length > 0
          ? {
              tools: options.tools,
              // SmolLM3's template reads them as `xml_tools` (its first revision only so).
              ...(this.#xmlTools ? { xml_tools: options.tools } : {}),
            }
          : {}),
      });
    } catch (err) {
      throw new PromptError(
        `the chat template refused the conversation: ${(err as Error).message}`,
      );
    }
  }

  /** A message as templates read it: OpenAI's field names, a tool call's arguments as an object
   * (templates write them with `tojson`). */
  #templateMessage(message: ChatMessage): Record<string, unknown> {
    const role = message.role === "developer" && this.#developerAsSystem ? "system" : message.role;
    const out: Record<string, unknown> = { role, content: message.content };
    if (message.toolCalls && message.toolCalls.length > 0) {
      out.tool_calls = message.toolCalls.map((call) => ({
        ...(call.id ? { id: call.id } : {}),
        type: "function",
        function: { name: call.name, arguments: parseArguments(call.arguments) },
      }));
    }
    if (message.toolCallId) out.tool_call_id = message.toolCallId;
    if (message.name) out.name = message.name;
    return out;
  }
}

function parseArguments(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

/** A conversation's tokens, with the assistant turns to learn from. */
export interface TrainingTokens {
  tokens: number[];
  /** 1 on every token of a selected assistant turn: its reply and its end-of-turn token. */
  mask: Uint8Array;
  /** Each selected assistant message's token range [start, end), by message index. */
  turns: Map<number, [number, number]>;
}

/** What a model talks with, as read from its folder. */
export interface ChatFiles {
  tokenizer: TokenizerFiles;
  /** Where the tokenizer came from, for errors. */
  tokenizerFile: string;
  /** The chat template's source. */
  template: string;
  /** Where the template came from, for errors. */
  templateFile: string;
  generation: GenerationConfig;
}

/**
 * How a model talks: its tokenizer, its chat template, and the tokens that end an assistant
 * turn. It renders conversations to token ids the way the template defines them, with special
 * tokens only where the template wrote them (never out of a message's text).
 */
export class ChatFormat {
  readonly files: ChatFiles;
  /** The end-of-sequence ids of the model's config.json and generation_config.json. */
  readonly eosIds: readonly number[];
  readonly tokenizer: Tokenizer;
  readonly template: ChatTemplate;
  /** The ids that end a turn or the text: the template's end-of-turn token, and the model's
   * end-of-sequence ids. Generation stops at any of them. */
  readonly stopIds: ReadonlySet<number>;

  constructor(files: ChatFiles, configEosIds: readonly number[]) {
    this.files = files;
    this.eosIds = [...new Set([...configEosIds, ...files.generation.eosTokenId])];
    this.tokenizer = new Tokenizer(files.tokenizer, files.tokenizerFile);
    this.template = new ChatTemplate(
      files.template,
      templateVariables(files.tokenizer.config),
      files.templateFile,
    );
    this.stopIds = new Set([...this.eosIds, ...this.#endOfTurn()]);
  }

  /** The conversation's prompt tokens (TokenLimitError once they reach `limit`). */
  encode(messages: readonly ChatMessage[], options: RenderOptions = {}): number[] {
    const { tokenizer, template } = this;
    const specials = tokenizer.specialTexts;
    const prefill = options.prefill ?? "";
    const text = template.render(messages, options) + prefill;
    const sent = JSON.stringify([messages, options.tools ?? null]);
    const limit = options.limit;
    if (!specials.some((s) => sent.includes(s)))
      return tokenizer.encode(text, { special: true, ...(limit ? { limit } : {}) });
    return this.#encodeGuarded(
      text,
      template.render(blank(messages, specials), {
        ...options,
        ...(options.tools ? { tools: blank(options.tools, specials) } : {}),
      }) + prefill,
      limit ?? Number.POSITIVE_INFINITY,
    );
  }

  /**
   * Tokens for training, with the assistant turns `trainable` selects masked for the loss. A
   * turn's tokens are found as the template places them: the conversation up to the turn,
   * rendered with the generation prompt, is a prefix of the whole; the turn runs from there to
   * its first end-of-turn token, which it includes.
   */
  trainingTokens(
    messages: readonly ChatMessage[],
    trainable: (index: number) => boolean,
    options: Pick<RenderOptions, "tools"> = {},
  ): TrainingTokens {
    const tokens = this.encode(messages, options);
    const mask = new Uint8Array(tokens.length);
    const turns = new Map<number, [number, number]>();
    messages.forEach((message, i) => {
      if (message.role !== "assistant" || !trainable(i)) return;
      const prefix = this.encode(messages.slice(0, i), { ...options, addGenerationPrompt: true });
      if (prefix.some((id, k) => tokens[k] !== id)) {
        throw new PromptError(
          `the chat template renders the conversation before message ${i} differently on its own than within the whole, so its assistant turn cannot be located`,
        );
      }
      let end = prefix.length;
      while (end < tokens.length && !this.stopIds.has(tokens[end]!)) end++;
      end = Math.min(end + 1, tokens.length);
      mask.fill(1, prefix.length, end);
      turns.set(i, [prefix.length, end]);
    });
    return { tokens, mask, turns };
  }

  /**
   * When a message's text (or a tool definition) contains a special token's text, the chat is
   * rendered a second time with that text blanked out (same length), which shows where the
   * template itself put special tokens: only those become special ids, and the rest of `text`
   * is encoded as plain text.
   */
  #encodeGuarded(text: string, blanked: string, limit: number): number[] {
    const { tokenizer } = this;
    if (blanked.length !== text.length) {
      throw new PromptError(
        "a message contains a control token's text, and this chat template changes the text around it",
      );
    }
    const ids: number[] = [];
    // Each piece of plain text may take what is left of the limit.
    const plain = (piece: string) => {
      let part: number[];
      try {
        part = tokenizer.encode(piece, { special: false, limit: limit - ids.length });
      } catch (err) {
        if (err instanceof TokenLimitError) throw new TokenLimitError(ids.length + err.tokens);
        throw err;
      }
      for (const id of part) ids.push(id);
    };
    let last = 0;
    let trimNext = false;
    for (const match of blanked.matchAll(specialPattern(tokenizer.specialTexts))) {
      const token = tokenizer.specialToken(match[0])!;
      let before = text.slice(last, match.index);
      if (trimNext) before = before.trimStart();
      if (token.lstrip) before = before.trimEnd();
      plain(before);
      ids.push(token.id);
      if (ids.length >= limit) throw new TokenLimitError(ids.length);
      last = match.index + match[0].length;
      trimNext = token.rstrip === true;
    }
    const rest = text.slice(last);
    plain(trimNext ? rest.trimStart() : rest);
    return ids;
  }

  /** The template's end-of-turn tokens: the special tokens it writes right after an assistant's
   * reply (`<|im_end|>`, `<|eot_id|>`). */
  #endOfTurn(): number[] {
    const user: ChatMessage = { role: "user", content: "Hi" };
    try {
      const prompt = this.encode([user], { addGenerationPrompt: true });
      const whole = this.encode([user, { role: "assistant", content: "Hello" }]);
      const after = whole.slice(prompt.length);
      const first = after.find((id) => this.tokenizer.isSpecial(id));
      return first === undefined ? [] : [first];
    } catch {
      // A template that refuses this probe still works for what it accepts.
      return [];
    }
  }
}

/** `value` with every special token's text in its strings replaced by as many private-use
 * characters. */
function blank<T>(value: T, specials: readonly string[]): T {
  if (typeof value === "string") {
    return specials.reduce((t, s) => t.replaceAll(s, "\uE000".repeat(s.length)), value) as T;
  }
  if (Array.isArray(value)) return value.map((v) => blank(v, specials)) as T;
  if (value && typeof value === "object") {
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, blank(v, specials)])) as T;
  }
  return value;
}

function specialPattern(specials: readonly string[]): RegExp {
  return new RegExp(specials.map((s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")).join("|"), "g");
}

/** The special tokens' texts that chat templates read (`bos_token`, `eos_token`…). */
function templateVariables(config: Record<string, unknown>): Record<string, string> {
  const out: Record<string, string> = {};
  for (const name of ["bos_token", "eos_token", "pad_token", "unk_token"]) {
    const value = config[name];
    if (typeof value === "string") out[name] = value;
    else if (value && typeof value === "object") {
      const content = (value as { content?: unknown }).content;
      if (typeof content === "string") out[name] = content;
    }
  }
  return out;
}
