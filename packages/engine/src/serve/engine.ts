import type { Kernels } from "../kernels/types.ts";
import { defaultKernels } from "../kernels/wasm.ts";
import type { ChatMessage, RenderOptions } from "../model/chat.ts";
import type { ModelConfig } from "../model/config.ts";
import { createKvCache, forwardBatch, type KvCache, releaseKvCache } from "../model/forward.ts";
import { checkAdapter, type LoraAdapter } from "../model/lora.ts";
import type { Model } from "../model/model.ts";
import { deriveSeed, Rng, randomSeed } from "../model/rng.ts";
import { heldSuffix } from "../model/text.ts";
import { TokenLimitError } from "../model/tokenizer.ts";
import { JsonConstraint, type JsonSchema } from "./json-constraint.ts";
import { PromptEncoder } from "./prompt-encoder.ts";
import {
  applyPenalties,
  applyRepetitionPenalty,
  logSoftmax,
  sampleToken,
  topLogprobs,
} from "./sampling.ts";

export type ResponseFormat =
  | { type: "text" }
  | { type: "json_object" }
  | { type: "json_schema"; schema: JsonSchema };

/**
 * Where the calls a model chooses to make open, and what they are constrained to (ADR 60, 63):
 * each time the text reaches `trigger`, what follows is constrained to `schema` until that
 * value is complete. With `anchored`, the trigger opens a call only where the text before it
 * (since the reply's start, or since the last call's end), without whitespace, is one of
 * `first` (no call yet) or `next` (after one): a Llama 3 reply is a call when it starts as one.
 * A trigger elsewhere ends the looking: the reply is text. With `opensValue`, the trigger is the
 * value's own start (Llama's `{`), else the value follows it (`<tool_call>`).
 */
export interface ToolCallConstraint {
  trigger: string;
  schema: JsonSchema;
  anchored?: { first: readonly string[]; next: readonly string[] };
  opensValue?: boolean;
}

/** What a chat prompt is rendered with besides its messages: the tools, and a prefilled start of
 * the reply. */
export type ChatPromptOptions = Pick<RenderOptions, "tools" | "prefill">;

export interface GenerateRequest {
  /** Chat messages, rendered with the model's chat template and its generation prompt… */
  messages?: readonly ChatMessage[];
  /** …with these tool definitions (OpenAI's `tools`), when the template renders tools. */
  tools?: readonly Record<string, unknown>[];
  /** …or a raw prompt, as text or token ids. */
  prompt?: string | readonly number[];
  /** Defaults to the rest of the context window. */
  maxTokens?: number;
  /** 0 is greedy. Default: the model's generation_config.json, else 1. */
  temperature?: number;
  /** Defaults, like `temperature`, come from generation_config.json when it has them. */
  topP?: number;
  /** Sample among the k most likely tokens only (0: no cut). */
  topK?: number;
  /** Drop tokens less likely than `minP` × the most likely one's probability. */
  minP?: number;
  /** Hugging Face's: logits of tokens already in the prompt or the output are divided by it
   * (multiplied when negative). 1: none. */
  repetitionPenalty?: number;
  /** The same seed and request give the same output; without one, each request draws a fresh
   * seed (and each of its `n` choices its own stream from it). */
  seed?: number;
  stop?: readonly string[];
  logprobs?: boolean;
  /** Alternatives per token, 0–20 (needs logprobs). */
  topLogprobs?: number;
  presencePenalty?: number;
  frequencyPenalty?: number;
  responseFormat?: ResponseFormat;
  /**
   * Tool calls constrained where the model makes them: each time the text reaches `trigger`
   * (a call's opening, such as `<tool_call>`), what follows is constrained to `schema` until
   * that value is complete; then the model goes on freely.
   */
  toolCalls?: ToolCallConstraint;
  /** Number of choices. Default 1. */
  n?: number;
  /**
   * A LoRA adapter of this engine's base model. Sequences with different adapters (or none)
   * share each forward pass: the base GEMMs run over all rows, each adapter's low-rank update
   * over its own rows.
   */
  adapter?: LoraAdapter | null;
  /**
   * Tinker's sampling (ADR 71): token ids that end a sequence besides the model's own stop
   * tokens, and every stop token kept as the sequence's last token, with its log-prob.
   */
  stopTokenIds?: readonly number[];
  keepStopToken?: boolean;
}

export type FinishReason = "stop" | "length";

export interface TokenLogprob {
  token: number;
  text: string;
  logprob: number;
  topLogprobs: { token: number; text: string; logprob: number }[];
}

export type GenerationEvent =
  | { type: "token"; choice: number; token: number; text: string; logprob?: TokenLogprob }
  | {
      type: "done";
      choice: number;
      finishReason: FinishReason;
      /** Text not yet streamed (held back while it could have begun a stop string). */
      delta: string;
      text: string;
      tokens: number[];
      promptTokens: number;
    };

export interface CompletionChoice {
  index: number;
  text: string;
  tokens: number[];
  finishReason: FinishReason;
  logprobs: TokenLogprob[] | null;
}

export interface Completion {
  choices: CompletionChoice[];
  usage: { promptTokens: number; completionTokens: number; totalTokens: number };
}

interface Sequence {
  choice: number;
  request: Required<
    Omit<
      GenerateRequest,
      | "messages"
      | "tools"
      | "prompt"
      | "responseFormat"
      | "stop"
      | "adapter"
      | "toolCalls"
      | "stopTokenIds"
      | "keepStopToken"
    >
  > & {
    stopTokenIds: ReadonlySet<number>;
    keepStopToken: boolean;
    stop: readonly string[];
    json: JsonSchema | null;
    toolCalls: GenerateRequest["toolCalls"] | null;
  };
  cache: KvCache;
  adapter: LoraAdapter | null;
  capacity: number;
  /** Tokens to feed: the prompt, then each sampled token; `fed` of them are in the cache. */
  pending: number[];
  fed: number;
  promptTokens: number;
  generated: number[];
  counts: Map<number, number>;
  /** Every token of the prompt and the output, for the repetition penalty. */
  seen: Set<number>;
  rng: Rng;
  json: JsonConstraint | null;
  /** With `toolCalls`: where in the text the next trigger is looked for. */
  triggerFrom: number;
  /** With `toolCalls`: how many calls have opened. */
  calls: number;
  /** JSON output being closed early because the token budget runs out: it ends as `length`. */
  truncated: boolean;
  emittedChars: number;
  queue: EventQueue;
  finished: boolean;
}

/**
 * Runs generation requests with continuous batching: every scheduler step stacks the pending
 * tokens of all live sequences (prompt prefill and single-token decode alike) into one forward
 * pass, so concurrent requests share each GEMM. Requests join and leave between steps.
 */
export class Engine {
  readonly model: Model;
  readonly kernels: Kernels;
  private active: Sequence[] = [];
  private running = false;
  private readonly stopTokens: Set<number>;
  private tokenTexts: (string | null)[] | null = null;
  private readonly charTokens = new Map<string, number>();
  /** Forward passes run so far, and the largest number of sequences in one (for tests/metrics). */
  readonly stats = { steps: 0, maxBatch: 0, tokens: 0 };

  /**
   * The work one scheduler step may do, in tokens at the start of the context; longer prompts
   * are prefilled in chunks. A token further in costs more (`stepCost`: its attention reads
   * every earlier position), so a long prompt's chunks shrink as it goes and each step takes
   * about as long as the first: nothing waits long for the next step.
   */
  readonly maxStepTokens: number;
  /** `attentionSpan` of the model. */
  readonly #span: number;

  constructor(model: Model, options: { kernels?: Kernels; maxStepTokens?: number } = {}) {
    this.model = model;
    this.maxStepTokens = Math.max(1, options.maxStepTokens ?? 512);
    this.#span = attentionSpan(model.config);
    this.kernels = options.kernels ?? defaultKernels();
    this.stopTokens = new Set(model.chat.stopIds);
  }

  get activeSequences(): number {
    return this.active.length;
  }

  #prompts: PromptEncoder | undefined;

  /**
   * The chat as prompt tokens with the generation prompt, without holding up this thread (large
   * prompts are tokenized on a worker thread). Throws ContextLengthError when it cannot leave
   * room for one generated token, found from the byte length alone when it is far too long.
   */
  encodeChat(messages: readonly ChatMessage[], options: ChatPromptOptions = {}): Promise<number[]> {
    this.#prompts ??= new PromptEncoder(this.model.chat);
    return this.#prompts.encodeChat(messages, {
      ...options,
      addGenerationPrompt: true,
      contextLength: this.model.config.maxPositions,
    });
  }

  /** Stops this engine's helper threads (the prompt encoder's). */
  async dispose(): Promise<void> {
    await this.#prompts?.dispose();
  }

  /** Streams token events for every choice, then one `done` event per choice. */
  generate(
    request: GenerateRequest,
    options: { signal?: AbortSignal } = {},
  ): AsyncIterableIterator<GenerationEvent> {
    const signal = options.signal;
    signal?.throwIfAborted();
    if (request.adapter) checkAdapter(this.model, request.adapter);
    const prompt = this.promptTokens(request);
    const n = request.n ?? 1;
    if (!Number.isInteger(n) || n < 1 || n > 128)
      throw new Error("generate: n must be an integer from 1 to 128");
    const limit = this.model.config.maxPositions;
    if (prompt.length === 0) throw new Error("generate: empty prompt");
    if (prompt.length >= limit)
      throw new Error(
        `generate: prompt of ${prompt.length} tokens fills the ${limit}-token context`,
      );
    const maxTokens = Math.min(request.maxTokens ?? limit, limit - prompt.length);
    const alternatives = Math.min(20, Math.max(0, request.topLogprobs ?? 0));
    const defaults = this.model.generation;
    const json =
      request.responseFormat?.type === "json_object"
        ? ({ type: "object" } as JsonSchema)
        : request.responseFormat?.type === "json_schema"
          ? request.responseFormat.schema
          : null;
    const normalized: Sequence["request"] = {
      maxTokens,
      temperature: request.temperature ?? defaults.temperature ?? 1,
      topP: request.topP ?? defaults.topP ?? 1,
      topK: request.topK ?? defaults.topK ?? 0,
      minP: request.minP ?? defaults.minP ?? 0,
      repetitionPenalty: request.repetitionPenalty ?? defaults.repetitionPenalty ?? 1,
      seed: request.seed ?? randomSeed(),
      stop: request.stop ?? [],
      stopTokenIds: new Set(request.stopTokenIds ?? []),
      keepStopToken: request.keepStopToken ?? false,
      logprobs: request.logprobs ?? alternatives > 0,
      topLogprobs: alternatives,
      presencePenalty: request.presencePenalty ?? 0,
      frequencyPenalty: request.frequencyPenalty ?? 0,
      n,
      json,
      toolCalls: json ? null : (request.toolCalls ?? null),
    };
    const sequences: Sequence[] = [];
    const queue = new EventQueue(n, () => {
      for (const s of sequences) s.finished = true;
    });
    for (let choice = 0; choice < n; choice++) {
      const capacity = prompt.length + maxTokens;
      sequences.push({
        choice,
        request: normalized,
        cache: createKvCache(this.model, capacity, this.kernels),
        adapter: request.adapter ?? null,
        capacity,
        pending: [...prompt],
        fed: 0,
        promptTokens: prompt.length,
        generated: [],
        counts: new Map(),
        seen: new Set(prompt),
        rng: new Rng(deriveSeed(normalized.seed, choice)),
        json: json ? new JsonConstraint(json) : null,
        triggerFrom: 0,
        calls: 0,
        truncated: false,
        emittedChars: 0,
        queue,
        finished: false,
      });
    }
    if (signal) {
      const onAbort = () => queue.fail(signal.reason ?? new Error("aborted"));
      signal.addEventListener("abort", onAbort, { once: true });
      queue.onSettle = () => signal.removeEventListener("abort", onAbort);
    }
    if (maxTokens <= 0) {
      for (const s of sequences) {
        this.finish(s, "length");
        releaseKvCache(s.cache);
      }
    } else {
      this.active.push(...sequences);
      void this.run();
    }
    return queue;
  }

  /** Runs a request to the end and collects the choices. */
  async complete(
    request: GenerateRequest,
    options: { signal?: AbortSignal } = {},
  ): Promise<Completion> {
    const n = request.n ?? 1;
    const choices: CompletionChoice[] = Array.from({ length: n }, (_, index) => ({
      index,
      text: "",
      tokens: [],
      finishReason: "length" as FinishReason,
      logprobs: request.logprobs || (request.topLogprobs ?? 0) > 0 ? [] : null,
    }));
    let promptTokens = 0;
    for await (const event of this.generate(request, options)) {
      const choice = choices[event.choice]!;
      if (event.type === "token") {
        if (event.logprob) choice.logprobs?.push(event.logprob);
      } else {
        choice.text = event.text;
        choice.tokens = event.tokens;
        choice.finishReason = event.finishReason;
        promptTokens = event.promptTokens;
      }
    }
    const completionTokens = choices.reduce((sum, c) => sum + c.tokens.length, 0);
    return {
      choices,
      usage: { promptTokens, completionTokens, totalTokens: promptTokens + completionTokens },
    };
  }

  /** The request's prompt ids; text is tokenized only as far as the context. */
  private promptTokens(request: GenerateRequest): number[] {
    const limit = this.model.config.maxPositions;
    try {
      if (request.messages) {
        return this.model.chat.encode(request.messages, {
          addGenerationPrompt: true,
          tools: request.tools,
          limit,
        });
      }
      if (typeof request.prompt === "string")
        return this.model.tokenizer.encode(request.prompt, { special: true, limit });
    } catch (err) {
      if (!(err instanceof TokenLimitError)) throw err;
      throw new Error(
        `generate: prompt of at least ${err.tokens} tokens fills the ${limit}-token context`,
      );
    }
    if (request.prompt) return [...request.prompt];
    throw new Error("generate: give messages or a prompt");
  }

  /**
   * The log-probability of each prompt token given the ones before it, NaN at position 0
   * (Tinker's `prompt_logprobs`, ADR 71): teacher-forced one token per forward pass through a
   * cache of its own, between the scheduler's steps.
   */
  promptLogprobs(tokens: readonly number[], adapter: LoraAdapter | null = null): Float64Array {
    if (adapter) checkAdapter(this.model, adapter);
    if (tokens.length > this.model.config.maxPositions)
      throw new Error(
        `promptLogprobs: ${tokens.length} tokens exceed the ${this.model.config.maxPositions}-token context`,
      );
    const out = new Float64Array(tokens.length).fill(Number.NaN);
    const cache = createKvCache(this.model, Math.max(1, tokens.length), this.kernels);
    try {
      for (let i = 0; i + 1 < tokens.length; i++) {
        const [logits] = forwardBatch(this.model, this.kernels, [
          { cache, tokens: [tokens[i]!], adapter },
        ]);
        out[i + 1] = logSoftmax(logits!, null)[tokens[i + 1]!]!;
      }
    } finally {
      releaseKvCache(cache);
    }
    return out;
  }

  private async run(): Promise<void> {
    if (this.running) return;
    this.running = true;
    try {
      while (this.active.length > 0) {
        // Let new requests join and consumers drain before each step.
        await new Promise((resolve) => setImmediate(resolve));
        this.dropFinished();
        const live = this.active;
        if (live.length === 0) break;
        const batch = this.#nextBatch(live);
        let logits: Float32Array[];
        try {
          logits = forwardBatch(
            this.model,
            this.kernels,
            batch.map(({ s, tokens }) => ({ cache: s.cache, tokens, adapter: s.adapter })),
          );
        } catch (error) {
          for (const { s } of batch) {
            s.finished = true;
            s.queue.fail(error);
          }
          continue;
        }
        this.stats.steps++;
        this.stats.maxBatch = Math.max(this.stats.maxBatch, batch.length);
        batch.forEach(({ s, tokens }, i) => {
          this.stats.tokens += tokens.length;
          if (s.finished) return;
          s.fed += tokens.length;
          if (s.fed < s.pending.length) return;
          try {
            this.advance(s, logits[i]!);
          } catch (error) {
            s.finished = true;
            s.queue.fail(error);
          }
        });
        this.dropFinished();
      }
    } finally {
      this.running = false;
    }
  }

  /**
   * The step's tokens. Decoding sequences (one token to feed) always run; prompt chunks share
   * what is left of the step's work. The prompts with the least work left go first, so a short
   * chat is not queued behind a long document's prefill; the oldest prompt keeps a sixteenth of
   * the step and at least one token, so a stream of shorter ones cannot starve it.
   */
  #nextBatch(live: readonly Sequence[]): { s: Sequence; tokens: number[] }[] {
    const span = this.#span;
    let budget = this.maxStepTokens;
    const batch: { s: Sequence; tokens: number[] }[] = [];
    const prompts: Sequence[] = [];
    for (const s of live) {
      const left = s.pending.length - s.fed;
      if (left === 1) {
        batch.push({ s, tokens: s.pending.slice(s.fed) });
        budget -= stepCost(1, s.cache.length, span);
      } else if (left > 1) prompts.push(s);
    }
    if (prompts.length === 0) return batch;
    const oldest = prompts[0]!;
    const share = prompts.length > 1 ? this.maxStepTokens / 16 : 0;
    const work = new Map(
      prompts.map((s) => [s, stepCost(s.pending.length - s.fed, s.cache.length, span)]),
    );
    budget -= share;
    for (const s of prompts.sort((a, b) => work.get(a)! - work.get(b)!)) {
      const allowance = s === oldest ? budget + share : budget;
      let take = chunkWithin(allowance, s.cache.length, span, s.pending.length - s.fed);
      if (s === oldest) take = Math.max(take, 1);
      budget = allowance - (take > 0 ? stepCost(take, s.cache.length, span) : 0);
      if (take > 0) batch.push({ s, tokens: s.pending.slice(s.fed, s.fed + take) });
    }
    return batch;
  }

  /** Takes finished sequences out of the batch and frees their caches' memory. */
  private dropFinished(): void {
    for (const s of this.active) if (s.finished) releaseKvCache(s.cache);
    this.active = this.active.filter((s) => !s.finished);
  }

  private advance(s: Sequence, rawLogits: Float32Array): void {
    const r = s.request;
    const logits = Float32Array.from(rawLogits);
    applyRepetitionPenalty(logits, s.seen, r.repetitionPenalty);
    applyPenalties(logits, s.counts, r.presencePenalty, r.frequencyPenalty);
    let allowed: Uint8Array | null = null;
    let forced: number | null = null;
    if (s.json) {
      const remaining = r.maxTokens - s.generated.length;
      const completion = s.json.completion();
      if (remaining <= completion.length) {
        forced = this.charToken(completion[0]!);
        s.truncated = true;
      } else {
        // Near the budget, only allow tokens after which the value can still be closed in time.
        // (A token can lengthen the completion by its own text plus a new key's minimal value.)
        const near = remaining - completion.length <= this.maxTokenChars() + 64;
        const budget = near ? remaining - 1 : null;
        allowed = this.jsonMask(s.json, budget);
        if (!allowed.includes(1)) {
          forced = this.charToken(completion[0]!);
          s.truncated ||= near;
        }
      }
    }
    let logprobs = logSoftmax(logits, allowed);
    // A forced token may lie outside the mask: report the model's own log-probability for it.
    if (forced !== null && !Number.isFinite(logprobs[forced]!)) logprobs = logSoftmax(logits, null);
    const token =
      forced ??
      sampleToken(
        logprobs,
        { temperature: r.temperature, topP: r.topP, topK: r.topK, minP: r.minP },
        s.rng,
      );
    const stopToken = (this.stopTokens.has(token) || r.stopTokenIds.has(token)) && !s.json;
    if (stopToken && !r.keepStopToken) {
      this.finish(s, "stop");
      return;
    }
    s.generated.push(token);
    s.counts.set(token, (s.counts.get(token) ?? 0) + 1);
    s.seen.add(token);
    s.json?.feed(this.texts()[token] ?? "");

    const full = this.model.tokenizer.decode(s.generated);
    if (r.toolCalls && !s.json) this.#startToolCall(s, r.toolCalls, full);
    let end = full.length;
    let stopped = false;
    for (const stop of r.stop) {
      const at = stop.length > 0 ? full.indexOf(stop) : -1;
      if (at >= 0 && at < end) {
        end = at;
        stopped = true;
      }
    }
    let safe = end;
    if (!stopped) {
      // Hold back text that may be the start of a stop string or of a split UTF-8 character.
      for (const stop of r.stop) safe = Math.min(safe, full.length - heldSuffix(full, stop));
      if (full.endsWith("\uFFFD")) safe = Math.min(safe, full.length - 1);
    }
    const delta = full.slice(s.emittedChars, Math.max(s.emittedChars, safe));
    s.emittedChars = Math.max(s.emittedChars, safe);
    let logprob: TokenLogprob | undefined;
    if (r.logprobs) {
      const texts = this.texts();
      logprob = {
        token,
        text: this.model.tokenizer.decode([token]),
        logprob: logprobs[token]!,
        topLogprobs: topLogprobs(logprobs, r.topLogprobs).map((t) => ({
          token: t.token,
          text: texts[t.token] ?? this.model.tokenizer.decode([t.token]),
          logprob: t.logprob,
        })),
      };
    }
    s.queue.push({
      type: "token",
      choice: s.choice,
      token,
      text: delta,
      ...(logprob ? { logprob } : {}),
    });
    if (stopped || stopToken) {
      this.finish(s, "stop", full.slice(0, end));
      return;
    }
    if (s.json?.complete) {
      if (!r.toolCalls || s.truncated) {
        this.finish(s, s.truncated ? "length" : "stop");
        return;
      }
      // The call is whole: the model goes on freely, and may make another.
      s.json = null;
      s.triggerFrom = full.length;
    }
    if (s.generated.length >= r.maxTokens || s.cache.length + 1 > s.capacity) {
      this.finish(s, "length");
      return;
    }
    s.pending = [token];
    s.fed = 0;
  }

  /** Constrains what follows a tool call's opening, once the text has reached one. */
  #startToolCall(
    s: Sequence,
    toolCalls: NonNullable<GenerateRequest["toolCalls"]>,
    full: string,
  ): void {
    const at = full.indexOf(toolCalls.trigger, s.triggerFrom);
    if (at < 0) return;
    if (toolCalls.anchored) {
      const before = full.slice(s.triggerFrom, at).replace(/\s+/g, "");
      const allowed = s.calls === 0 ? toolCalls.anchored.first : toolCalls.anchored.next;
      if (!allowed.includes(before)) {
        s.triggerFrom = Number.POSITIVE_INFINITY;
        return;
      }
    }
    s.triggerFrom = at + toolCalls.trigger.length;
    s.calls++;
    const json = new JsonConstraint(toolCalls.schema);
    // The token that ended the opening may have begun the value; if that cannot be one, the
    // call is left to the model (and is read as text).
    const value = full.slice(toolCalls.opensValue ? at : s.triggerFrom);
    if (json.feed(value) && !json.complete) s.json = json;
  }

  private finish(s: Sequence, reason: FinishReason, text?: string): void {
    s.finished = true;
    const full = text ?? this.model.tokenizer.decode(s.generated);
    s.queue.push({
      type: "done",
      choice: s.choice,
      finishReason: reason,
      delta: full.slice(s.emittedChars),
      text: full,
      tokens: s.generated,
      promptTokens: s.promptTokens,
    });
    s.queue.choiceDone();
  }

  /** Decoded text of each token, or null for special tokens and partial UTF-8. */
  private texts(): (string | null)[] {
    if (!this.tokenTexts) {
      const t = this.model.tokenizer;
      this.tokenTexts = Array.from({ length: this.model.config.vocabSize }, (_, id) => {
        if (id >= t.vocabSize || t.isSpecial(id)) return null;
        const text = t.decode([id]);
        return text.length === 0 || text.includes("\uFFFD") ? null : text;
      });
    }
    return this.tokenTexts;
  }

  private jsonMask(state: JsonConstraint, budget: number | null): Uint8Array {
    const texts = this.texts();
    const mask = new Uint8Array(texts.length);
    // Inside a free-text string, text without quotes, backslashes or control characters is
    // always valid and leaves the shortest completion unchanged: skip simulating it.
    const freeString =
      state.inFreeString && (budget === null || state.completion().length <= budget);
    const firstChar = new Map<string, boolean>();
    texts.forEach((text, id) => {
      if (text === null) return;
      if (freeString && this.plain(id)) {
        mask[id] = 1;
        return;
      }
      const first = text[0]!;
      let ok = firstChar.get(first);
      if (ok === undefined) {
        ok = state.clone().feed(first);
        firstChar.set(first, ok);
      }
      if (!ok) return;
      const next = state.clone();
      if (!next.feed(text)) return;
      if (budget !== null && next.completion().length > budget) return;
      mask[id] = 1;
    });
    return mask;
  }

  private plainTokens: Uint8Array | null = null;

  /** Whether a token's text can sit inside a JSON string as is. */
  private plain(id: number): boolean {
    if (!this.plainTokens) {
      this.plainTokens = Uint8Array.from(this.texts(), (text) => {
        if (text === null) return 0;
        for (let i = 0; i < text.length; i++) {
          const code = text.charCodeAt(i);
          if (code < 0x20 || code === 0x22 || code === 0x5c) return 0;
        }
        return 1;
      });
    }
    return this.plainTokens[id] === 1;
  }

  private longestToken = 0;

  private maxTokenChars(): number {
    if (this.longestToken === 0) {
      for (const text of this.texts())
        this.longestToken = Math.max(this.longestToken, text?.length ?? 0);
    }
    return this.longestToken;
  }

  private charToken(ch: string): number {
    let id = this.charTokens.get(ch);
    if (id === undefined) {
      const ids = this.model.tokenizer.encode(ch, { special: false });
      if (ids.length !== 1) throw new Error(`tokenizer has no token for ${JSON.stringify(ch)}`);
      id = ids[0]!;
      this.charTokens.set(ch, id);
    }
    return id;
  }
}

/** An async iterator fed by the scheduler; ends after every choice is done. */
class EventQueue implements AsyncIterableIterator<GenerationEvent> {
  private readonly events: GenerationEvent[] = [];
  private waiting: {
    resolve: (r: IteratorResult<GenerationEvent>) => void;
    reject: (e: unknown) => void;
  } | null = null;
  private remaining: number;
  private error: unknown = null;
  private closed = false;
  private readonly cancel: () => void;
  onSettle: (() => void) | null = null;

  constructor(choices: number, cancel: () => void) {
    this.remaining = choices;
    this.cancel = cancel;
  }

  push(event: GenerationEvent): void {
    if (this.closed) return;
    if (this.waiting) {
      const { resolve } = this.waiting;
      this.waiting = null;
      resolve({ value: event, done: false });
    } else {
      this.events.push(event);
    }
  }

  choiceDone(): void {
    this.remaining--;
    if (this.remaining === 0) this.settle();
  }

  fail(error: unknown): void {
    if (this.closed) return;
    this.error = error;
    this.cancel();
    this.settle();
    if (this.waiting) {
      const { reject } = this.waiting;
      this.waiting = null;
      reject(error);
    }
  }

  private settle(): void {
    this.closed = true;
    this.onSettle?.();
    if (this.waiting && this.events.length === 0 && this.error === null) {
      const { resolve } = this.waiting;
      this.waiting = null;
      resolve({ value: undefined, done: true });
    }
  }

  next(): Promise<IteratorResult<GenerationEvent>> {
    const event = this.events.shift();
    if (event) return Promise.resolve({ value: event, done: false });
    if (this.error !== null) return Promise.reject(this.error);
    if (this.closed) return Promise.resolve({ value: undefined, done: true });
    return new Promise((resolve, reject) => {
      this.waiting = { resolve, reject };
    });
  }

  return(): Promise<IteratorResult<GenerationEvent>> {
    if (!this.closed) {
      this.cancel();
      this.closed = true;
      this.onSettle?.();
    }
    this.events.length = 0;
    return Promise.resolve({ value: undefined, done: true });
  }

  [Symbol.asyncIterator](): AsyncIterableIterator<GenerationEvent> {
    return this;
  }
}

/**
 * How many cached positions one token's attention reads for the multiply-adds of its own matrix
 * products (q, k, v, o and the MLP; the vocabulary projection, once per sequence, is left
 * out): the unit `stepCost` measures attention in. tiny-chat's is 720, Qwen3-0.6B's about 3,800.
 */
export function attentionSpan(config: ModelConfig): number {
  const q = config.numHeads * config.headDim;
  const kv = config.numKvHeads * config.headDim;
  const h = config.hiddenSize;
  const products = 2 * h * q + 2 * h * kv + 3 * h * config.intermediateSize;
  // Each cached position costs a q·k and a weighted v per head.
  return products / (2 * q);
}

/**
 * The work of feeding `tokens` tokens after `depth` cached ones, in tokens at the start of the
 * context: each token's matrix products (1) and its attention over every position up to its
 * own (depth + i + 1 of them, in units of `span`).
 */
export function stepCost(tokens: number, depth: number, span: number): number {
  return tokens + (tokens * (depth + (tokens + 1) / 2)) / span;
}

/** The most tokens, up to `max`, that can be fed after `depth` cached ones within `budget`
 * (`stepCost`); 0 when not even one can. */
export function chunkWithin(budget: number, depth: number, span: number, max: number): number {
  if (budget <= 0 || max <= 0) return 0;
  // stepCost(t) = a·t + t²/(2·span): the root of stepCost(t) = budget, then checked exactly.
  const a = 1 + (depth + 0.5) / span;
  const c = 1 / (2 * span);
  let take = Math.min(max, Math.floor((-a + Math.sqrt(a * a + 4 * c * budget)) / (2 * c)));
  while (take < max && stepCost(take + 1, depth, span) <= budget) take++;
  while (take > 0 && stepCost(take, depth, span) > budget) take--;
  return Math.max(0, take);
}
