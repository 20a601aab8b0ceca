import { availableParallelism } from "node:os";
import { type ChatMessage, deriveSeed, heldSuffix, randomSeed } from "@arbor/engine/model";
import type { GenerationEvent, ThreadGenerateRequest } from "@arbor/engine/serve";

/** ChatML's markers: a GGUF whose vocabulary has them as single tokens is rendered as ChatML. */
const IM_START = "<|im_start|>";
const IM_END = "<|im_end|>";
const END_OF_TEXT = "<|endoftext|>";

/**
 * An optional llama.cpp backend for user-supplied GGUF chat models, on CPU, through the optional
 * dependency `node-llama-cpp` (its prebuilt CPU binaries ship inside the npm packages
 * `@node-llama-cpp/<platform>`; nothing is downloaded or built at install or run time).
 *
 * It exposes the engine-like surface the chat service drives: `contextLength`,
 * `countPromptTokens(messages)` and `generate(request, {signal})`, yielding the same events as
 * `Engine.generate` (a `token` event per generated token whose `text` is the newly streamable
 * text, then one `done` event per choice).
 *
 * Honoured GenerateRequest fields: messages | prompt, maxTokens, temperature (0 = greedy),
 * topP, seed, stop, n (choices run one after another).
 * NOT honoured — requesting any of them throws an Error naming the field (map it to a 400):
 * - `logprobs` / `topLogprobs`: the token-level API used here does not hand out the distribution.
 * - `responseFormat` json_object / json_schema: our JsonConstraint works on our tokenizer; a
 *   llama.cpp grammar would be a different implementation of the same contract.
 * - `presencePenalty` / `frequencyPenalty` (non-zero): llama.cpp's penalties take a bounded
 *   window and a 0–1 range, not OpenAI's −2…2 over the whole completion.
 * - `adapter`: LoRA checkpoints are our engine's; this backend serves the GGUF as it is.
 *
 * Prompt rendering: when the GGUF's vocabulary has `<|im_start|>` and `<|im_end|>` as single
 * tokens, messages are rendered as ChatML exactly like our engine's `renderChat` — the same text,
 * each piece tokenized on its own, the markers taken only from the template and never parsed out
 * of message content (no prompt injection of control tokens). For a GGUF exported from our models
 * this gives the very token ids our Engine uses, so outputs can be compared token for token.
 * Any other GGUF is rendered with its own chat template through node-llama-cpp's chat wrappers
 * (`resolveChatWrapper`), since ChatML would be the wrong format for, e.g., a Llama 3 model.
 */

/** The part of node-llama-cpp used here, typed locally so the server type-checks (and runs)
 * when the optional package is absent. */
type Token = number;
interface NlcEvaluateOptions {
  temperature?: number;
  topK?: number;
  topP?: number;
  minP?: number;
  seed?: number;
  yieldEogToken?: boolean;
}
interface NlcSequence {
  evaluate(tokens: Token[], options?: NlcEvaluateOptions): AsyncGenerator<Token, void, void>;
  clearHistory(): Promise<void>;
  dispose(): void;
}
interface NlcContext {
  readonly contextSize: number;
  getSequence(): NlcSequence;
  dispose(): Promise<void>;
}
interface NlcModel {
  readonly trainContextSize: number;
  readonly tokenizer: unknown;
  tokenize(text: string, specialTokens?: boolean): Token[];
  detokenize(tokens: readonly Token[], specialTokens?: boolean): string;
  isEogToken(token: Token | undefined): boolean;
  createContext(options: {
    contextSize?: number;
    sequences?: number;
    threads?: number;
    lora?: string;
  }): Promise<NlcContext>;
  dispose(): Promise<void>;
}
interface NlcLlama {
  loadModel(options: { modelPath: string; gpuLayers?: number }): Promise<NlcModel>;
}
type NlcHistoryItem =
  | { type: "system"; text: string }
  | { type: "user"; text: string }
  | { type: "model"; response: string[] };
interface NlcModule {
  getLlama(options: Record<string, unknown>): Promise<NlcLlama>;
  resolveChatWrapper(model: NlcModel): {
    generateContextState(options: { chatHistory: NlcHistoryItem[] }): {
      contextText: { tokenize(tokenizer: unknown): Token[] };
    };
  };
}

export const LLAMA_NOT_INSTALLED =
  "node-llama-cpp is not installed: install the server's optional dependencies " +
  "(NODE_LLAMA_CPP_SKIP_DOWNLOAD=true pnpm install) to serve GGUF models";

let llamaPromise: Promise<{ module: NlcModule; llama: NlcLlama }> | undefined;

/** One llama.cpp instance per process, CPU only, from the prebuilt binary or not at all. */
function getLlamaCpu(): Promise<{ module: NlcModule; llama: NlcLlama }> {
  llamaPromise ??= (async () => {
    let module: NlcModule;
    try {
      const specifier = "node-llama-cpp";
      module = (await import(specifier)) as NlcModule;
    } catch (err) {
      const code = (err as { code?: string }).code;
      if (code === "ERR_MODULE_NOT_FOUND" || code === "MODULE_NOT_FOUND") {
        throw new Error(LLAMA_NOT_INSTALLED, { cause: err });
      }
      throw err;
    }
    const llama = await module.getLlama({
      gpu: false,
      // Prebuilt binaries only: never compile llama.cpp, never download its source.
      build: "never",
      skipDownload: true,
      usePrebuiltBinaries: true,
      progressLogs: false,
      logLevel: "error",
    });
    return { module, llama };
  })();
  llamaPromise.catch(() => {
    llamaPromise = undefined;
  });
  return llamaPromise;
}

export interface LlamaCppOptions {
  /** Context window in tokens; default the model's training context, at most 4096. */
  contextSize?: number;
  /** CPU threads for evaluation; default one less than the cores (at least 1). llama.cpp's
   * threads spin while they wait, so more threads than free cores makes decoding ~100× slower
   * (measured here: 4 threads on 2 busy cores, 1.8 s a token; 1 thread, 1–2 ms). */
  threads?: number;
  /** A llama.cpp LoRA GGUF applied on top of the model (a checkpoint's `gguf-lora` download). */
  lora?: string;
}

interface Loaded {
  module: NlcModule;
  model: NlcModel;
  context: NlcContext;
  sequence: NlcSequence;
  chatml: { start: Token; end: Token } | null;
  stopTokens: Set<Token>;
}

const DEFAULT_MAX_CONTEXT = 4096;

/** A GGUF chat model served by llama.cpp on CPU; loads on first use. One generation at a time
 * (requests queue up); the model and its KV cache stay in memory until `dispose()`. */
export class LlamaCppBackend {
  readonly path: string;
  readonly #options: LlamaCppOptions;
  #loading: Promise<Loaded> | undefined;
  #loaded: Loaded | undefined;
  #queue: Promise<void> = Promise.resolve();

  constructor(path: string, options: LlamaCppOptions = {}) {
    this.path = path;
    this.#options = options;
  }

  /** Loads the model (once); every other method calls it. Rejects with `LLAMA_NOT_INSTALLED`
   * when the optional package is absent. */
  load(): Promise<void> {
    return this.#load().then(() => undefined);
  }

  get loaded(): boolean {
    return this.#loaded !== undefined;
  }

  /** The context window in tokens (prompt plus completion). Needs `await load()` first. */
  get contextLength(): number {
    if (!this.#loaded) throw new Error(`llama.cpp model ${this.path} is not loaded yet`);
    return this.#loaded.context.contextSize;
  }

  /** Tokens the rendered chat (with the assistant generation prompt) takes. */
  async countPromptTokens(messages: readonly ChatMessage[]): Promise<number> {
    const loaded = await this.#load();
    return renderPrompt(loaded, messages).length;
  }

  /** Streams token events for every choice, then one `done` event per choice — choices run one
   * after the other. Throws the signal's reason when aborted. */
  async *generate(
    request: ThreadGenerateRequest,
    options: { signal?: AbortSignal } = {},
  ): AsyncGenerator<GenerationEvent, void, undefined> {
    const signal = options.signal;
    signal?.throwIfAborted();
    checkSupported(request);
    const n = request.n ?? 1;
    if (!Number.isInteger(n) || n < 1 || n > 128)
      throw new Error("generate: n must be an integer from 1 to 128");
    const loaded = await this.#load();
    const prompt = promptTokens(loaded, request);
    const limit = loaded.context.contextSize;
    if (prompt.length === 0) throw new Error("generate: empty prompt");
    if (prompt.length >= limit)
      throw new Error(
        `generate: prompt of ${prompt.length} tokens fills the ${limit}-token context`,
      );
    const maxTokens = Math.min(request.maxTokens ?? limit, limit - prompt.length);
    // Without a seed, sampling is random: one fresh seed per request, a stream per choice.
    const seeded = { ...request, seed: request.seed ?? randomSeed() };
    const release = await this.#lock(signal);
    try {
      for (let choice = 0; choice < n; choice++) {
        yield* this.#choice(loaded, seeded, prompt, maxTokens, choice, signal);
      }
    } finally {
      release();
    }
  }

  /** Frees the model and its context (the shared llama.cpp instance stays). */
  async dispose(): Promise<void> {
    const loading = this.#loading;
    this.#loading = undefined;
    this.#loaded = undefined;
    if (!loading) return;
    const loaded = await loading.catch(() => undefined);
    if (!loaded) return;
    await loaded.context.dispose();
    await loaded.model.dispose();
  }

  async *#choice(
    loaded: Loaded,
    request: ThreadGenerateRequest,
    prompt: Token[],
    maxTokens: number,
    choice: number,
    signal: AbortSignal | undefined,
  ): AsyncGenerator<GenerationEvent, void, undefined> {
    const { model, sequence } = loaded;
    const stop = (request.stop ?? []).filter((s) => s.length > 0);
    const generated: Token[] = [];
    let emitted = 0;
    const done = (finishReason: "stop" | "length", text?: string): GenerationEvent => {
      const full = text ?? model.detokenize(generated, false);
      return {
        type: "done",
        choice,
        finishReason,
        delta: full.slice(emitted),
        text: full,
        tokens: [...generated],
        promptTokens: prompt.length,
      };
    };
    if (maxTokens <= 0) {
      yield done("length");
      return;
    }
    await sequence.clearHistory();
    const temperature = request.temperature ?? 1;
    const tokens = sequence.evaluate([...prompt], {
      temperature,
      topP: request.topP ?? 1,
      topK: 0,
      minP: 0,
      seed: deriveSeed(request.seed ?? 0, choice),
      yieldEogToken: true,
    });
    try {
      for (;;) {
        signal?.throwIfAborted();
        const next = await tokens.next();
        signal?.throwIfAborted();
        if (next.done) {
          // The sequence ran out of context.
          yield done("length");
          return;
        }
        const token = next.value;
        if (loaded.stopTokens.has(token) || model.isEogToken(token)) {
          yield done("stop");
          return;
        }
        generated.push(token);
        const full = model.detokenize(generated, false);
        let end = full.length;
        let stopped = false;
        for (const s of stop) {
          const at = full.indexOf(s);
          if (at >= 0 && at < end) {
            end = at;
            stopped = true;
          }
        }
        let safe = end;
        if (!stopped) {
          // Hold back text that may begin a stop string or end in a split UTF-8 character.
          for (const s of stop) safe = Math.min(safe, full.length - heldSuffix(full, s));
          if (full.endsWith("\uFFFD")) safe = Math.min(safe, full.length - 1);
        }
        const text = full.slice(emitted, Math.max(emitted, safe));
        emitted = Math.max(emitted, safe);
        yield { type: "token", choice, token, text };
        if (stopped) {
          yield done("stop", full.slice(0, end));
          return;
        }
        if (generated.length >= maxTokens) {
          yield done("length");
          return;
        }
      }
    } finally {
      // Ends llama.cpp's evaluation of this choice (also on abort or an early `return()`).
      await tokens.return(undefined);
    }
  }

  #load(): Promise<Loaded> {
    this.#loading ??= (async () => {
      const { module, llama } = await getLlamaCpu();
      const model = await llama.loadModel({ modelPath: this.path, gpuLayers: 0 });
      try {
        const contextSize =
          this.#options.contextSize ?? Math.min(model.trainContextSize, DEFAULT_MAX_CONTEXT);
        const context = await model.createContext({
          contextSize,
          sequences: 1,
          threads: this.#options.threads ?? Math.max(1, availableParallelism() - 1),
          ...(this.#options.lora ? { lora: this.#options.lora } : {}),
        });
        const single = (text: string): Token | null => {
          const ids = model.tokenize(text, true);
          return ids.length === 1 ? ids[0]! : null;
        };
        const start = single(IM_START);
        const end = single(IM_END);
        const chatml = start !== null && end !== null ? { start, end } : null;
        const stopTokens = new Set<Token>();
        for (const marker of [IM_END, END_OF_TEXT]) {
          const id = single(marker);
          if (id !== null) stopTokens.add(id);
        }
        const loaded: Loaded = {
          module,
          model,
          context,
          sequence: context.getSequence(),
          chatml,
          stopTokens,
        };
        this.#loaded = loaded;
        return loaded;
      } catch (err) {
        await model.dispose();
        throw err;
      }
    })();
    const loading = this.#loading;
    loading.catch(() => {
      if (this.#loading === loading) this.#loading = undefined;
    });
    return loading;
  }

  /** Waits for the previous generation to finish (one sequence, one generation at a time). */
  async #lock(signal: AbortSignal | undefined): Promise<() => void> {
    const previous = this.#queue;
    let release!: () => void;
    this.#queue = new Promise<void>((r) => {
      release = r;
    });
    if (signal) {
      let onAbort: (() => void) | undefined;
      const aborted = new Promise<never>((_, reject) => {
        onAbort = () => reject(signal.reason ?? new Error("aborted"));
        signal.addEventListener("abort", onAbort, { once: true });
      });
      try {
        await Promise.race([previous, aborted]);
      } catch (err) {
        // Keep the queue order: release only once the one before us is done.
        void previous.then(release);
        throw err;
      } finally {
        signal.removeEventListener("abort", onAbort!);
      }
    } else {
      await previous;
    }
    return release;
  }
}

/** A ThreadGenerateRequest field this backend cannot honour; `field` names it (map to a 400). */
export class LlamaUnsupportedError extends Error {
  readonly field: string;
  constructor(field: string, why: string) {
    super(`${field} is not supported by the llama.cpp backend: ${why}`);
    this.name = "LlamaUnsupportedError";
    this.field = field;
  }
}

/** Throws a LlamaUnsupportedError for the first field the backend cannot honour. `generate`
 * calls it too, but a server should call it before it starts a (streamed) response. */
export function checkSupported(request: ThreadGenerateRequest): void {
  const refuse = (field: string, why: string) => {
    throw new LlamaUnsupportedError(field, why);
  };
  if (request.logprobs || (request.topLogprobs ?? 0) > 0)
    refuse(request.logprobs ? "logprobs" : "topLogprobs", "it does not report token logprobs");
  const format = request.responseFormat?.type;
  if (format && format !== "text") refuse(`responseFormat.${format}`, "no constrained decoding");
  if (request.presencePenalty) refuse("presencePenalty", "no presence penalty");
  if (request.frequencyPenalty) refuse("frequencyPenalty", "no frequency penalty");
  // `adapter` (a LoRA checkpoint of our engine) is read untyped: not every engine version has it.
  if ((request as { adapter?: unknown }).adapter)
    refuse("adapter", "LoRA checkpoints run on the built-in engine only");
}

function promptTokens(loaded: Loaded, request: ThreadGenerateRequest): Token[] {
  if (request.messages) return renderPrompt(loaded, request.messages);
  if (typeof request.prompt === "string") return loaded.model.tokenize(request.prompt, true);
  if (request.prompt) return [...request.prompt];
  throw new Error("generate: give messages or a prompt");
}

/** The chat as prompt tokens, with the assistant generation prompt (see the file comment). */
function renderPrompt(loaded: Loaded, messages: readonly ChatMessage[]): Token[] {
  const { model, chatml } = loaded;
  if (chatml) {
    const tokens: Token[] = [];
    const text = (piece: string) => {
      if (piece) tokens.push(...model.tokenize(piece, false));
    };
    for (const message of messages) {
      tokens.push(chatml.start);
      text(`${message.role}\n`);
      text(messageBody(message));
      tokens.push(chatml.end);
      text("\n");
    }
    tokens.push(chatml.start);
    text("assistant\n");
    return tokens;
  }
  const history: NlcHistoryItem[] = messages.map((m) =>
    m.role === "assistant"
      ? { type: "model", response: [messageBody(m)] }
      : m.role === "system" || m.role === "developer"
        ? { type: "system", text: m.content }
        : { type: "user", text: m.content },
  );
  history.push({ type: "model", response: [] });
  const wrapper = loaded.module.resolveChatWrapper(model);
  return wrapper
    .generateContextState({ chatHistory: history })
    .contextText.tokenize(model.tokenizer);
}

/** As the engine's renderChat: tool calls follow the content, Qwen-style. */
function messageBody(message: ChatMessage): string {
  let body = message.content;
  for (const call of message.toolCalls ?? []) {
    let args: unknown;
    try {
      args = JSON.parse(call.arguments);
    } catch {
      args = call.arguments;
    }
    body += `${body ? "\n" : ""}<tool_call>\n${JSON.stringify({ name: call.name, arguments: args })}\n</tool_call>`;
  }
  return body;
}
