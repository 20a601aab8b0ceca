import { Worker } from "node:worker_threads";
import {
  type ChatFormat,
  type ChatMessage,
  PromptError,
  type RenderOptions,
} from "../model/chat.ts";
import { TokenLimitError } from "../model/tokenizer.ts";

export { PromptError };

/** The prompt cannot fit the context; `exact` is false when `tokens` is a lower bound found from
 * the prompt's byte length before any tokenizing. */
export class ContextLengthError extends Error {
  override readonly name = "ContextLengthError";
  readonly tokens: number;
  readonly context: number;
  readonly exact: boolean;
  constructor(tokens: number, context: number, exact: boolean) {
    super(
      `The messages take ${exact ? "" : "at least "}${tokens} tokens; this model's context is ${context} tokens.`,
    );
    this.tokens = tokens;
    this.context = context;
    this.exact = exact;
  }
}

export interface PromptEncoderOptions {
  /** Prompts of up to this many UTF-8 bytes are rendered and tokenized on the calling thread
   * (well under a millisecond); larger ones on a worker thread, so the caller's event loop
   * never waits on them. Default 4 KiB. */
  inlineBytes?: number;
  /** Prompts of more than this many bytes are long: they are tokenized on a thread of their
   * own, so none holds up a shorter one (a 5 KB chat is not queued behind a 30 MB document).
   * Default 64 KiB, about 40 ms of Qwen3's tokenizer. */
  longBytes?: number;
}

/**
 * Renders and tokenizes chat prompts without holding up the calling thread: first a bound from
 * the byte length alone (a token covers at most the vocabulary's longest token in bytes, so a
 * prompt that cannot fit is refused before any work), then small prompts inline, larger ones on
 * a worker thread, and long ones on a second worker thread; each worker holds its own copy of
 * the tokenizer and is started on first use. Tokenizing stops once the prompt fills the
 * context (`limit` of `ChatFormat.encode`): a long document that passes the byte bound costs
 * the work of a context's worth of its text, not all of it.
 */
export class PromptEncoder {
  readonly #chat: ChatFormat;
  readonly #inlineBytes: number;
  readonly #longBytes: number;
  /** The longest token of the vocabulary, in bytes. */
  readonly maxTokenBytes: number;
  readonly #short: PromptThread;
  readonly #long: PromptThread;

  constructor(chat: ChatFormat, options: PromptEncoderOptions = {}) {
    this.#chat = chat;
    this.#inlineBytes = options.inlineBytes ?? 4096;
    this.#longBytes = options.longBytes ?? 64 * 1024;
    this.maxTokenBytes = chat.tokenizer.maxTokenBytes();
    this.#short = new PromptThread(chat);
    this.#long = new PromptThread(chat);
  }

  /** The prompt's tokens; ContextLengthError when it cannot leave room for one generated token
   * in `contextLength`. */
  async encodeChat(
    messages: readonly ChatMessage[],
    options: RenderOptions & { contextLength?: number } = {},
  ): Promise<number[]> {
    const { contextLength: _, ...rest } = options;
    const render: RenderOptions = { addGenerationPrompt: true, ...rest };
    const bytes = promptBytes(messages, options.tools);
    const context = options.contextLength;
    if (context !== undefined) {
      const atLeast = Math.ceil(bytes / this.maxTokenBytes);
      if (atLeast >= context) throw new ContextLengthError(atLeast, context, false);
    }
    // One past the context: a prompt that takes exactly the context is refused with its count.
    if (context !== undefined) render.limit = context + 1;
    let tokens: number[];
    try {
      tokens =
        bytes <= this.#inlineBytes
          ? this.#chat.encode(messages, render)
          : await (bytes > this.#longBytes ? this.#long : this.#short).encode(messages, render);
    } catch (err) {
      if (err instanceof TokenLimitError && context !== undefined) {
        // Counted past the context and no further: at least that many.
        throw new ContextLengthError(err.tokens, context, false);
      }
      throw err;
    }
    if (context !== undefined && tokens.length >= context) {
      throw new ContextLengthError(tokens.length, context, true);
    }
    return tokens;
  }

  /** Stops the worker threads, if any were started; pending prompts are refused. */
  async dispose(): Promise<void> {
    await Promise.all([this.#short.dispose(), this.#long.dispose()]);
  }
}

interface Pending {
  resolve: (tokens: number[]) => void;
  reject: (error: Error) => void;
}

/** One worker thread that renders and tokenizes prompts, in the order they are sent. */
class PromptThread {
  readonly #chat: ChatFormat;
  #worker: Worker | undefined;
  readonly #pending = new Map<number, Pending>();
  #nextId = 0;

  constructor(chat: ChatFormat) {
    this.#chat = chat;
  }

  encode(messages: readonly ChatMessage[], options: RenderOptions): Promise<number[]> {
    const worker = this.#start();
    const id = this.#nextId++;
    return new Promise<number[]>((resolve, reject) => {
      this.#pending.set(id, { resolve, reject });
      worker.postMessage({ id, messages, options });
      worker.ref();
    });
  }

  async dispose(): Promise<void> {
    const worker = this.#worker;
    this.#worker = undefined;
    this.#failAll(new Error("the prompt encoder was disposed"));
    await worker?.terminate();
  }

  #start(): Worker {
    if (this.#worker) return this.#worker;
    const worker = new Worker(new URL("./prompt-worker.ts", import.meta.url), {
      workerData: { files: this.#chat.files, eosIds: this.#chat.eosIds },
    });
    worker.unref();
    worker.on(
      "message",
      (reply: { id: number; tokens?: Int32Array; error?: string; atLeast?: number }) => {
        const pending = this.#pending.get(reply.id);
        if (!pending) return;
        this.#pending.delete(reply.id);
        if (this.#pending.size === 0) worker.unref();
        if (reply.tokens) pending.resolve(Array.from(reply.tokens));
        else if (reply.atLeast !== undefined) pending.reject(new TokenLimitError(reply.atLeast));
        else pending.reject(new PromptError(reply.error ?? "the prompt could not be encoded"));
      },
    );
    const lost = (err: unknown) => {
      if (this.#worker === worker) this.#worker = undefined;
      this.#failAll(
        new Error(
          `the prompt encoder's thread stopped: ${err instanceof Error ? err.message : String(err)}`,
        ),
      );
    };
    worker.on("error", lost);
    worker.on("exit", (code) => lost(new Error(`exit code ${code}`)));
    this.#worker = worker;
    return worker;
  }

  #failAll(error: Error): void {
    const pending = [...this.#pending.values()];
    this.#pending.clear();
    for (const p of pending) p.reject(error);
  }
}

/**
 * A lower bound on the UTF-8 bytes of everything a prompt's messages and tool definitions
 * carry: their UTF-16 length (every code unit is at least one byte). O(1) per string, where
 * counting the bytes themselves took 9 ms for a 9 MB message.
 */
export function promptBytes(
  messages: readonly ChatMessage[],
  tools?: RenderOptions["tools"],
): number {
  let bytes = JSON.stringify(tools ?? []).length;
  for (const m of messages) {
    bytes += m.content.length;
    for (const call of m.toolCalls ?? []) bytes += call.name.length + call.arguments.length;
  }
  return bytes;
}
