import { Worker } from "node:worker_threads";
import type { ChatMessage } from "../model/chat.ts";
import type { ModelConfig } from "../model/config.ts";
import type { WeightChoice } from "../model/model.ts";
import type { ToolCallFormat } from "../model/tool-calls.ts";
import type { ChatPromptOptions, GenerateRequest, GenerationEvent } from "./engine.ts";
import { ContextLengthError, PromptError, promptBytes } from "./prompt-encoder.ts";

/** What an engine thread serves, read once it has loaded its model. */
export interface EngineThreadInfo {
  config: ModelConfig;
  /** The longest token of the vocabulary in bytes: bounds a prompt from its byte length. */
  maxTokenBytes: number;
  parameters: number;
  /** How the model's chat template writes tool calls; null when it writes none. */
  toolCallFormat: ToolCallFormat | null;
}

/** The engine's counters, for tests and metrics. */
export interface EngineThreadStats {
  steps: number;
  maxBatch: number;
  tokens: number;
  activeSequences: number;
}

/** A request for an engine thread: an adapter is named by the id it was loaded under. */
export type ThreadGenerateRequest = Omit<GenerateRequest, "adapter"> & { adapter?: string | null };

/** What the main thread sends its engine thread. */
export type ToEngineThread =
  | { type: "encode"; id: number; messages: readonly ChatMessage[]; options: ChatPromptOptions }
  | { type: "generate"; id: number; request: ThreadGenerateRequest }
  | { type: "cancel"; id: number }
  | { type: "adapter"; id: number; key: string; files: Record<string, Uint8Array> }
  | { type: "drop-adapter"; key: string }
  | { type: "stats"; id: number }
  | { type: "prompt-logprobs"; id: number; tokens: number[]; adapter: string | null };

/** What an engine thread sends back. */
export type FromEngineThread =
  | { type: "ready"; info: EngineThreadInfo }
  | { type: "failed"; message: string }
  | { type: "encoded"; id: number; tokens: Int32Array }
  | { type: "prompt-logprobs"; id: number; logprobs: Float64Array }
  | { type: "events"; id: number; events: GenerationEvent[] }
  | { type: "end"; id: number }
  | { type: "error"; id: number; name: string; message: string; tokens?: number; context?: number }
  | { type: "done"; id: number; stats?: EngineThreadStats };

interface Stream {
  push(events: GenerationEvent[]): void;
  end(): void;
  fail(error: Error): void;
}

/**
 * An engine on its own thread: the model, prompt rendering, the continuous-batching scheduler
 * and sampling all run there, so no forward pass or long prompt ever holds up the caller's
 * event loop (the HTTP server's). Adapters are loaded into the thread once and named by a key.
 */
export class EngineThread {
  readonly info: EngineThreadInfo;
  readonly #worker: Worker;
  readonly #pending = new Map<
    number,
    { resolve: (value: unknown) => void; reject: (e: Error) => void }
  >();
  readonly #streams = new Map<number, Stream>();
  #nextId = 0;
  #failure: Error | undefined;

  private constructor(worker: Worker, info: EngineThreadInfo) {
    this.#worker = worker;
    this.info = info;
    worker.on("message", (message: FromEngineThread) => this.#receive(message));
    const lost = (err: Error) => {
      this.#failure = err;
      for (const p of this.#pending.values()) p.reject(err);
      for (const s of this.#streams.values()) s.fail(err);
      this.#pending.clear();
      this.#streams.clear();
    };
    worker.on("error", (err) => lost(new Error(`the engine thread failed: ${err.message}`)));
    worker.on("exit", (code) => lost(new Error(`the engine thread exited (code ${code})`)));
  }

  /** Starts a thread that loads the model in `modelDir`, its weights packed in its kernels'
   * arena as their only copy (`weights`: F32, BF16 widened inside the kernels, or `auto`: BF16
   * for BF16 files, else F32; default F32);
   * `threads` kernel threads share its large kernel calls (the thread itself included). */
  static async start(
    modelDir: string,
    options: { threads?: number; weights?: WeightChoice } = {},
  ): Promise<EngineThread> {
    const worker = new Worker(new URL("./engine-thread-worker.ts", import.meta.url), {
      workerData: { modelDir, threads: options.threads ?? 1, weights: options.weights ?? "f32" },
    });
    const info = await new Promise<EngineThreadInfo>((resolve, reject) => {
      worker.once("message", (message: FromEngineThread) => {
        if (message.type === "ready") resolve(message.info);
        else reject(new Error(message.type === "failed" ? message.message : "unexpected message"));
      });
      worker.once("error", reject);
      worker.once("exit", (code) => reject(new Error(`the engine thread exited (code ${code})`)));
    }).catch(async (err: unknown) => {
      await worker.terminate();
      throw err;
    });
    return new EngineThread(worker, info);
  }

  /** Whether the thread died (it answers nothing more; start another). */
  get failed(): boolean {
    return this.#failure !== undefined;
  }

  /**
   * The chat as prompt tokens with the generation prompt. A prompt whose bytes alone cannot fit
   * the context is refused here, before it is copied to the thread.
   */
  async encodeChat(
    messages: readonly ChatMessage[],
    options: ChatPromptOptions = {},
  ): Promise<number[]> {
    const context = this.info.config.maxPositions;
    const atLeast = Math.ceil(promptBytes(messages, options.tools) / this.info.maxTokenBytes);
    if (atLeast >= context) throw new ContextLengthError(atLeast, context, false);
    const tokens = (await this.#call({ type: "encode", messages, options })) as Int32Array;
    return Array.from(tokens);
  }

  /** Loads a LoRA adapter (its PEFT files) into the thread under `key`. */
  async loadAdapter(key: string, files: Record<string, Uint8Array>): Promise<void> {
    await this.#call({ type: "adapter", key, files });
  }

  dropAdapter(key: string): void {
    if (!this.#failure) this.#worker.postMessage({ type: "drop-adapter", key });
  }

  /** `Engine.promptLogprobs` in the thread, with a loaded adapter named by its key. */
  async promptLogprobs(tokens: readonly number[], adapter: string | null): Promise<Float64Array> {
    return (await this.#call({
      type: "prompt-logprobs",
      tokens: [...tokens],
      adapter,
    })) as Float64Array;
  }

  async stats(): Promise<EngineThreadStats> {
    return (await this.#call({ type: "stats" })) as EngineThreadStats;
  }

  /** Streams generation events as `Engine.generate` does; `signal` (or leaving the iteration
   * early) cancels the request in the thread. */
  generate(
    request: ThreadGenerateRequest,
    options: { signal?: AbortSignal } = {},
  ): AsyncIterableIterator<GenerationEvent> {
    const id = this.#nextId++;
    const queue = new ThreadEventQueue(() => {
      this.#streams.delete(id);
      if (!this.#failure) this.#worker.postMessage({ type: "cancel", id } satisfies ToEngineThread);
    });
    if (this.#failure) {
      queue.fail(this.#failure);
      return queue;
    }
    const signal = options.signal;
    if (signal?.aborted) {
      queue.fail(signal.reason ?? new Error("aborted"));
      return queue;
    }
    const onAbort = () => queue.cancel(signal?.reason ?? new Error("aborted"));
    signal?.addEventListener("abort", onAbort, { once: true });
    queue.onSettle = () => signal?.removeEventListener("abort", onAbort);
    this.#streams.set(id, queue);
    this.#worker.postMessage({ type: "generate", id, request } satisfies ToEngineThread);
    return queue;
  }

  async dispose(): Promise<void> {
    await this.#worker.terminate();
  }

  #call(message: DistributiveOmit<ToEngineThread, "id">): Promise<unknown> {
    if (this.#failure) return Promise.reject(this.#failure);
    const id = this.#nextId++;
    return new Promise((resolve, reject) => {
      this.#pending.set(id, { resolve, reject });
      this.#worker.postMessage({ ...message, id });
    });
  }

  #receive(message: FromEngineThread): void {
    switch (message.type) {
      case "events":
        this.#streams.get(message.id)?.push(message.events);
        return;
      case "end":
        this.#streams.get(message.id)?.end();
        this.#streams.delete(message.id);
        return;
      case "encoded":
      case "prompt-logprobs":
      case "done": {
        const pending = this.#pending.get(message.id);
        this.#pending.delete(message.id);
        pending?.resolve(
          message.type === "encoded"
            ? message.tokens
            : message.type === "prompt-logprobs"
              ? message.logprobs
              : message.stats,
        );
        return;
      }
      case "error": {
        const error = rebuildError(message);
        const pending = this.#pending.get(message.id);
        if (pending) {
          this.#pending.delete(message.id);
          pending.reject(error);
          return;
        }
        this.#streams.get(message.id)?.fail(error);
        this.#streams.delete(message.id);
        return;
      }
    }
  }
}

type DistributiveOmit<T, K extends PropertyKey> = T extends unknown ? Omit<T, K> : never;

/** The thread's error as the kind the engine threw, so callers can tell input from failure. */
function rebuildError(message: Extract<FromEngineThread, { type: "error" }>): Error {
  if (message.name === "ContextLengthError") {
    return new ContextLengthError(message.tokens ?? 0, message.context ?? 0, true);
  }
  if (message.name === "PromptError") return new PromptError(message.message);
  const error = new Error(message.message);
  error.name = message.name;
  return error;
}

/** The caller's side of one generation: events as the thread sends them, in order. */
class ThreadEventQueue implements AsyncIterableIterator<GenerationEvent>, Stream {
  readonly #events: GenerationEvent[] = [];
  #waiting: {
    resolve: (r: IteratorResult<GenerationEvent>) => void;
    reject: (e: unknown) => void;
  } | null = null;
  #error: unknown = null;
  #closed = false;
  readonly #cancel: () => void;
  onSettle: (() => void) | null = null;

  constructor(cancel: () => void) {
    this.#cancel = cancel;
  }

  push(events: GenerationEvent[]): void {
    if (this.#closed) return;
    for (const event of events) {
      if (this.#waiting) {
        const { resolve } = this.#waiting;
        this.#waiting = null;
        resolve({ value: event, done: false });
      } else this.#events.push(event);
    }
  }

  end(): void {
    this.#settle();
  }

  fail(error: Error): void {
    if (this.#closed) return;
    this.#error = error;
    this.#settle();
  }

  /** The caller gave up (an abort): the thread stops the request, and the iteration fails. */
  cancel(reason: unknown): void {
    if (this.#closed) return;
    this.#cancel();
    this.#events.length = 0;
    this.#error = reason;
    this.#settle();
  }

  #settle(): void {
    this.#closed = true;
    this.onSettle?.();
    if (this.#waiting && this.#events.length === 0) {
      const { resolve, reject } = this.#waiting;
      this.#waiting = null;
      if (this.#error !== null) reject(this.#error);
      else resolve({ value: undefined, done: true });
    }
  }

  next(): Promise<IteratorResult<GenerationEvent>> {
    const event = this.#events.shift();
    if (event) return Promise.resolve({ value: event, done: false });
    if (this.#error !== null) return Promise.reject(this.#error);
    if (this.#closed) return Promise.resolve({ value: undefined, done: true });
    return new Promise((resolve, reject) => {
      this.#waiting = { resolve, reject };
    });
  }

  return(): Promise<IteratorResult<GenerationEvent>> {
    if (!this.#closed) {
      this.#cancel();
      this.#closed = true;
      this.onSettle?.();
    }
    this.#events.length = 0;
    return Promise.resolve({ value: undefined, done: true });
  }

  [Symbol.asyncIterator](): AsyncIterableIterator<GenerationEvent> {
    return this;
  }
}
