import { createHash } from "node:crypto";
import type { GenerationEvent } from "@arbor/engine/serve";
import type { components } from "@arbor/spec/schema";
import type { CallsRepo } from "@arbor/store";
import { uuidv7 } from "@arbor/store";
import type { Logger } from "pino";
import type { Principal } from "../access.ts";
import { type ChatRequest, toLogprobs } from "./chat.ts";
import type { ModelDirectory, ResolvedModel } from "./models.ts";
import { type InferenceCall, RecordedCall } from "./usage.ts";

type Schemas = components["schemas"];
export type ChatCompletion = Schemas["ChatCompletion"];
export type ChatCompletionChunk = Schemas["ChatCompletionChunk"];
type TokenLogprobs = NonNullable<
  NonNullable<ChatCompletion["choices"][number]["logprobs"]>["content"]
>;
type FinishReason = ChatCompletion["choices"][number]["finish_reason"];
/** A streamed piece of a tool call, as a chunk's `delta.tool_calls` has it. */
export type ToolCallDelta = NonNullable<
  ChatCompletionChunk["choices"][number]["delta"]["tool_calls"]
>[number];

/** What a backend reports as it generates, whatever it is (the engine, llama.cpp, an upstream). */
export type ChatEvent =
  /** New text of one choice; `tokens` is how many tokens it took, when the backend knows;
   * `held`: its text is held back (a tool call's possible start), so it has nothing to send. */
  | {
      type: "delta";
      choice: number;
      content: string;
      tokens: number;
      logprobs?: TokenLogprobs;
      held?: boolean;
    }
  /** A choice ended; `content` is text held back until now (a possible stop string's start). */
  | { type: "finish"; choice: number; content: string; finishReason: FinishReason }
  /** A piece of one of a choice's tool calls, as OpenAI streams them: the first has the call's
   * `id`, `type` and `name`, the next ones fragments of its `arguments` to append. */
  | { type: "tool_call"; choice: number; delta: ToolCallDelta }
  /** The backend's own count, when it has one (an upstream's `usage`). */
  | { type: "usage"; promptTokens: number; completionTokens: number };

/** A request a backend has checked and can run: every refusal of ours happened before this
 * exists. */
export interface PreparedChat {
  /** The prompt's tokens, when counted before generating (0 when the backend reports them). */
  promptTokens: number;
  /** Starts generating, once the call is recorded. It resolves when the backend has accepted
   * the request (an upstream's headers are in), so a refusal then is still an error response. */
  start(signal: AbortSignal): Promise<AsyncIterable<ChatEvent>>;
}

/** One way of serving chat (vLLM's layering): it checks a request and then runs it. */
export interface ChatBackend<R extends ResolvedModel> {
  prepare(resolved: R, request: ChatRequest): Promise<PreparedChat>;
}

export type ChatBackends = {
  [K in ResolvedModel["kind"]]: ChatBackend<Extract<ResolvedModel, { kind: K }>>;
};

/** The model a run is observed under. */
export interface ObservedModel {
  /** The id that served (a trained model's with its `:step<N>`). */
  id: string;
  /** The entity whose trained model it is; null for a base model (the engine's, llama.cpp's
   * or an upstream's, which the operator chose). */
  entity: string | null;
}

/** A resolved model as observed: trained when it is not its own base. */
export function observedModel(resolved: ResolvedModel): ObservedModel {
  const trained = resolved.kind !== "llama" && resolved.id !== resolved.baseId;
  return { id: resolved.id, entity: trained ? resolved.id.split("/")[0]! : null };
}

/** Told how each chat went, for metrics (it knows nothing of how they are exported). */
export interface ChatObserver {
  /** The run's first token (of any choice) came from its backend, `seconds` after the service
   * took the request: the same moment whether the answer is streamed or not. */
  firstToken(model: ObservedModel, seconds: number): void;
  /** A run ended (finished, failed, or its client gone), with the usage its call records and
   * the seconds from the backend's start to the end. */
  ended(run: {
    model: ObservedModel;
    backend: ResolvedModel["kind"];
    promptTokens: number;
    completionTokens: number;
    generationSeconds: number;
  }): void;
}

export interface ChatServiceDeps {
  directory: ModelDirectory;
  backends: ChatBackends;
  calls: CallsRepo;
  logger: Logger;
  observer?: ChatObserver;
}

/**
 * Chat completions over every backend. `start` resolves the model and has its backend check the
 * request (a refusal is an error before anything is recorded or sent), then records the call's
 * start (a store that cannot record refuses the request). The run's events are then read once,
 * as a completion or as chunks, and its usage is recorded in one place, however it ends.
 */
export class ChatService {
  readonly #deps: ChatServiceDeps;
  constructor(deps: ChatServiceDeps) {
    this.#deps = deps;
  }

  async start(principal: Principal, body: ChatRequest, call: InferenceCall): Promise<ChatRun> {
    const taken = performance.now();
    const resolved = await this.#deps.directory.resolve(principal, body.model);
    const prepared = await this.#prepare(resolved, body);
    const recorded = await RecordedCall.open(
      this.#deps.calls,
      call,
      resolved.id,
      this.#deps.logger,
    );
    return new ChatRun(resolved.id, body, prepared, recorded, {
      model: observedModel(resolved),
      backend: resolved.kind,
      taken,
      ...(this.#deps.observer ? { observer: this.#deps.observer } : {}),
    });
  }

  #prepare(resolved: ResolvedModel, body: ChatRequest): Promise<PreparedChat> {
    const { backends } = this.#deps;
    switch (resolved.kind) {
      case "engine":
        return backends.engine.prepare(resolved, body);
      case "llama":
        return backends.llama.prepare(resolved, body);
      case "upstream":
        return backends.upstream.prepare(resolved, body);
    }
  }
}

/** One started chat: read it once, with `complete` or `chunks`. */
export class ChatRun {
  readonly id = `chatcmpl-${uuidv7()}`;
  readonly created = Math.floor(Date.now() / 1000);
  readonly model: string;
  readonly fingerprint: string;
  readonly #body: ChatRequest;
  readonly #prepared: PreparedChat;
  readonly #call: RecordedCall;
  readonly #observed: ObservedRun;
  #completion: ChatCompletion | undefined;

  constructor(
    model: string,
    body: ChatRequest,
    prepared: PreparedChat,
    call: RecordedCall,
    observed: ObservedRun,
  ) {
    this.model = model;
    this.fingerprint = `fp_${createHash("sha256").update(model).digest("hex").slice(0, 10)}`;
    this.#body = body;
    this.#prepared = prepared;
    this.#call = call;
    this.#observed = observed;
  }

  /** Runs to the end and answers the whole completion. */
  async complete(signal: AbortSignal): Promise<ChatCompletion> {
    for await (const _ of this.#events(await this.#start(signal), signal));
    return this.#result();
  }

  /**
   * The completion as chunks: each choice's role first, then its text as it comes, its finish,
   * and the usage last when `stream_options.include_usage` asks for it. Nothing is yielded
   * before the backend has started, so its refusal (an upstream's 4xx, an outage) is still an
   * error response rather than a stream that fails.
   */
  async *chunks(signal: AbortSignal): AsyncGenerator<ChatCompletionChunk> {
    const started = await this.#start(signal);
    for (let index = 0; index < (this.#body.n ?? 1); index++) {
      yield this.#chunk([
        { index, delta: { role: "assistant", content: "" }, finish_reason: null },
      ]);
    }
    // A reader that stops early (the client left) ends the run, and so records it.
    for await (const event of this.#events(started, signal)) {
      // Tokens held back (a possible tool call's start) are counted, not sent.
      if (event.type === "delta" && event.held && !event.content && !event.logprobs) continue;
      yield this.#eventChunk(event);
    }
    if (this.#body.stream_options?.include_usage) yield this.#chunk([], this.#result().usage);
  }

  /** Starts the backend; when it refuses or fails, the call is ended with why, and it throws
   * (nothing was sent yet). */
  async #start(signal: AbortSignal): Promise<AsyncIterable<ChatEvent>> {
    try {
      return await this.#prepared.start(signal);
    } catch (err) {
      await this.#call.close({
        promptTokens: this.#prepared.promptTokens,
        completionTokens: 0,
        output: null,
        exception: exceptionText(err, signal),
      });
      throw err;
    }
  }

  #eventChunk(event: Exclude<ChatEvent, { type: "usage" }>): ChatCompletionChunk {
    if (event.type === "tool_call") {
      return this.#chunk([
        { index: event.choice, delta: { tool_calls: [event.delta] }, finish_reason: null },
      ]);
    }
    return this.#chunk([
      event.type === "delta"
        ? {
            index: event.choice,
            delta: { content: event.content },
            finish_reason: null,
            ...(event.logprobs ? { logprobs: { content: event.logprobs } } : {}),
          }
        : {
            index: event.choice,
            delta: event.content ? { content: event.content } : {},
            finish_reason: event.finishReason,
          },
    ]);
  }

  #result(): ChatCompletion {
    if (!this.#completion) throw new Error("the chat has not run yet");
    return this.#completion;
  }

  #chunk(
    choices: ChatCompletionChunk["choices"],
    usage?: ChatCompletionChunk["usage"],
  ): ChatCompletionChunk {
    return {
      id: this.id,
      object: "chat.completion.chunk",
      created: this.created,
      model: this.model,
      system_fingerprint: this.fingerprint,
      choices,
      ...(usage ? { usage } : {}),
    };
  }

  /**
   * The backend's events, gathered into the completion they make (`#result()`); the one
   * place a chat's call is ended, with its usage, however the run ends (finished, failed, or its
   * reader gone): the backend's own count when it gave one, else the tokens counted so far
   * (an upstream that sends no usage is counted a token per chunk of text).
   */
  async *#events(
    started: AsyncIterable<ChatEvent>,
    signal: AbortSignal,
  ): AsyncGenerator<Exclude<ChatEvent, { type: "usage" }>> {
    const choices = Array.from({ length: this.#body.n ?? 1 }, () => ({
      text: "",
      logprobs: [] as TokenLogprobs,
      finishReason: null as FinishReason | null,
      calls: [] as ToolCall[],
    }));
    let promptTokens = this.#prepared.promptTokens;
    let completionTokens = 0;
    let failure: unknown;
    let finished = false;
    const { observer, model, backend, taken } = this.#observed;
    const generating = performance.now();
    let first = true;
    try {
      for await (const event of started) {
        if (event.type === "usage") {
          ({ promptTokens, completionTokens } = event);
          continue;
        }
        if (first) {
          first = false;
          observer?.firstToken(model, (performance.now() - taken) / 1000);
        }
        const choice = choices[event.choice];
        if (!choice) continue;
        if (event.type === "tool_call") {
          addToolCall(choice.calls, event.delta);
          yield event;
          continue;
        }
        choice.text += event.content;
        if (event.type === "delta") {
          completionTokens += event.tokens;
          choice.logprobs.push(...(event.logprobs ?? []));
        } else {
          choice.finishReason = event.finishReason;
        }
        yield event;
      }
      finished = true;
    } catch (err) {
      failure = err;
    } finally {
      const completion: ChatCompletion = {
        id: this.id,
        object: "chat.completion",
        created: this.created,
        model: this.model,
        system_fingerprint: this.fingerprint,
        choices: choices.map((c, index) => ({
          index,
          message: {
            role: "assistant",
            // A turn that only calls tools has no content, as OpenAI answers it.
            content: c.calls.length > 0 && c.text.trim() === "" ? null : c.text,
            refusal: null,
            ...(c.calls.length > 0 ? { tool_calls: c.calls } : {}),
          },
          finish_reason: c.finishReason ?? "stop",
          logprobs: this.#body.logprobs ? { content: c.logprobs } : null,
        })),
        usage: {
          prompt_tokens: promptTokens,
          completion_tokens: completionTokens,
          total_tokens: promptTokens + completionTokens,
        },
      };
      this.#completion = completion;
      observer?.ended({
        model,
        backend,
        promptTokens,
        completionTokens,
        generationSeconds: (performance.now() - generating) / 1000,
      });
      await this.#call.close({
        promptTokens,
        completionTokens,
        output: finished ? completion : null,
        exception: finished ? null : exceptionText(failure, signal),
      });
    }
    // A client that left gets nothing more; its run ended as it should, not as a failure.
    if (failure !== undefined && !signal.aborted) throw failure;
  }
}

type ToolCall = NonNullable<ChatCompletion["choices"][number]["message"]["tool_calls"]>[number];

/** A streamed piece of a call added to a choice's calls: a piece with an id starts a call. */
function addToolCall(calls: ToolCall[], piece: ToolCallDelta): void {
  let call = calls[piece.index];
  if (!call) {
    call = {
      id: piece.id ?? `call_${piece.index}`,
      type: "function",
      function: { name: "", arguments: "" },
    };
    calls[piece.index] = call;
  }
  if (piece.function?.name) call.function.name += piece.function.name;
  if (piece.function?.arguments) call.function.arguments += piece.function.arguments;
}

/** What a run tells its observer besides its usage: its model, which backend ran it and when
 * the service took it (performance.now()). */
interface ObservedRun {
  model: ObservedModel;
  backend: ResolvedModel["kind"];
  taken: number;
  observer?: ChatObserver;
}

/** Why a run ended early, as its call records it: a client that left, or the failure. A reader
 * that stopped without a failure left too. */
function exceptionText(failure: unknown, signal: AbortSignal): string {
  if (signal.aborted || failure === undefined) return "cancelled: the client disconnected";
  return failure instanceof Error ? failure.message : String(failure);
}

/** The engine's (and llama.cpp's) generation events as chat events. */
export async function* generationEvents(
  generation: AsyncIterable<GenerationEvent>,
): AsyncGenerator<ChatEvent> {
  for await (const event of generation) {
    if (event.type === "token") {
      yield {
        type: "delta",
        choice: event.choice,
        content: event.text,
        tokens: 1,
        ...(event.logprob ? { logprobs: toLogprobs([event.logprob]) } : {}),
      };
    } else {
      yield {
        type: "finish",
        choice: event.choice,
        content: event.delta,
        finishReason: event.finishReason,
      };
    }
  }
}
