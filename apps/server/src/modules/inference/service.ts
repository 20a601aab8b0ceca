import { createHash } from "node:crypto";
import {
  ContextLengthError,
  type GenerationEvent,
  JsonConstraint,
  PromptError,
  type ThreadGenerateRequest,
  type TokenLogprob,
} from "@arbor/engine";
import type { components } from "@arbor/spec/schema";
import type { BlobStore, CallsRepo } from "@arbor/store";
import { uuidv7 } from "@arbor/store";
import type { Logger } from "pino";
import { ApiError } from "../../http/errors.ts";
import { type ChatRequest, toGenerateRequest, toLogprobs } from "./chat.ts";
import { CheckpointGoneError, type EngineHost } from "./engines.ts";
import { checkSupported, type LlamaCppBackend, LlamaUnsupportedError } from "./llama-cpp.ts";
import { type ModelDirectory, modelNotFound, type ResolvedModel } from "./models.ts";
import type { RecordedCall } from "./usage.ts";

type Schemas = components["schemas"];
export type ChatCompletion = Schemas["ChatCompletion"];
export type ChatCompletionChunk = Schemas["ChatCompletionChunk"];

export interface InferenceDeps {
  engines: EngineHost;
  /** Where trained checkpoints' adapter files are. */
  blobs: BlobStore | undefined;
  directory: ModelDirectory;
  calls: CallsRepo;
  logger: Logger;
}

/** One choice as it is being generated. */
interface ChoiceState {
  text: string;
  tokens: number;
  logprobs: TokenLogprob[];
  finishReason: "stop" | "length" | null;
}

/** What a streaming caller sees as the generation goes. */
export type ChatProgress =
  | { type: "delta"; choice: number; content: string; logprob?: TokenLogprob }
  | { type: "finish"; choice: number; content: string; finishReason: "stop" | "length" };

/** What generates: the embedded engine, or a llama.cpp backend with the same events. */
export interface Generator {
  generate(
    request: ThreadGenerateRequest,
    options: { signal?: AbortSignal },
  ): AsyncIterable<GenerationEvent>;
}

export interface PreparedChat {
  resolved: ResolvedModel;
  engine: Generator;
  request: ThreadGenerateRequest;
  promptTokens: number;
  id: string;
  created: number;
  fingerprint: string;
}

/** Checks the request against the engine's model, before any response is started. */
export async function prepareChat(
  deps: InferenceDeps,
  resolved: ResolvedModel,
  body: ChatRequest,
): Promise<PreparedChat> {
  const request = toGenerateRequest(body);
  if (resolved.llama) return prepareLlamaChat(resolved, resolved.llama, request);
  const engine = await deps.engines.engine(resolved.baseId);
  const prompt = await engine.encodeChat(request.messages ?? []).catch((err: unknown) => {
    if (err instanceof ContextLengthError) {
      throw new ApiError(400, err.message, {
        param: "messages",
        code: "context_length_exceeded",
      });
    }
    if (err instanceof PromptError) {
      throw ApiError.badRequest(`The messages cannot be rendered: ${err.message}`, "messages");
    }
    throw err;
  });
  if (request.responseFormat?.type === "json_schema") {
    try {
      new JsonConstraint(request.responseFormat.schema);
    } catch (err) {
      throw ApiError.badRequest(
        `response_format.json_schema.schema is not supported: ${err instanceof Error ? err.message : String(err)}`,
        "response_format.json_schema.schema",
        "unsupported_parameter",
      );
    }
  }
  // The adapter is read only for a request that can run.
  if (resolved.checkpoint) {
    request.adapter = await deps.engines
      .adapter(resolved.baseId, resolved.checkpoint, deps.blobs)
      .catch((err: unknown) => {
        if (err instanceof CheckpointGoneError) throw modelNotFound(resolved.id);
        throw err;
      });
  }
  const { messages: _, ...rest } = request;
  return prepared(resolved, engine, { ...rest, prompt }, prompt.length);
}

/** A user-supplied GGUF on llama.cpp: its own tokenizer counts the prompt; what it cannot
 * honour is a 400 naming the field. */
async function prepareLlamaChat(
  resolved: ResolvedModel,
  backend: LlamaCppBackend,
  request: ThreadGenerateRequest,
): Promise<PreparedChat> {
  try {
    checkSupported(request);
  } catch (err) {
    if (err instanceof LlamaUnsupportedError) {
      throw new ApiError(400, `\`${err.field}\` is not supported by this model.`, {
        param: err.field,
        code: "unsupported_parameter",
      });
    }
    throw err;
  }
  await backend.load();
  const promptTokens = await backend.countPromptTokens(request.messages ?? []);
  if (promptTokens >= backend.contextLength) {
    throw new ApiError(
      400,
      `The messages take ${promptTokens} tokens; this model's context is ${backend.contextLength} tokens.`,
      {
        param: "messages",
        code: "context_length_exceeded",
      },
    );
  }
  return prepared(resolved, backend, request, promptTokens);
}

function prepared(
  resolved: ResolvedModel,
  engine: Generator,
  request: ThreadGenerateRequest,
  promptTokens: number,
): PreparedChat {
  return {
    resolved,
    engine,
    request,
    promptTokens,
    id: `chatcmpl-${uuidv7()}`,
    created: Math.floor(Date.now() / 1000),
    fingerprint: `fp_${createHash("sha256").update(resolved.id).digest("hex").slice(0, 10)}`,
  };
}

/** Runs a prepared chat to its end (or its abort), reporting progress, and ends its recorded
 * call with the tokens actually produced — streamed, cancelled and failed requests included. */
export async function runChat(
  chat: PreparedChat,
  call: RecordedCall,
  signal: AbortSignal,
  onProgress: (progress: ChatProgress) => void = () => {},
): Promise<ChatCompletion> {
  const n = chat.request.n ?? 1;
  const choices: ChoiceState[] = Array.from({ length: n }, () => ({
    text: "",
    tokens: 0,
    logprobs: [],
    finishReason: null,
  }));
  let failure: unknown;
  try {
    for await (const event of chat.engine.generate(chat.request, { signal })) {
      const state = choices[event.choice]!;
      if (event.type === "token") {
        state.tokens += 1;
        if (event.logprob) state.logprobs.push(event.logprob);
        if (event.text) state.text += event.text;
        onProgress({
          type: "delta",
          choice: event.choice,
          content: event.text,
          ...(event.logprob ? { logprob: event.logprob } : {}),
        });
      } else {
        state.text = event.text;
        state.finishReason = event.finishReason;
        onProgress({
          type: "finish",
          choice: event.choice,
          content: event.delta,
          finishReason: event.finishReason,
        });
      }
    }
  } catch (err) {
    failure = err;
  }
  const completion = toCompletion(chat, choices);
  const exception =
    failure === undefined
      ? null
      : signal.aborted
        ? "cancelled: the client disconnected"
        : errorText(failure);
  await call.close({
    promptTokens: chat.promptTokens,
    completionTokens: completion.usage.completion_tokens,
    output: failure === undefined ? completion : null,
    exception,
  });
  if (failure !== undefined) throw failure;
  return completion;
}

function toCompletion(chat: PreparedChat, choices: ChoiceState[]): ChatCompletion {
  const completionTokens = choices.reduce((sum, c) => sum + c.tokens, 0);
  return {
    id: chat.id,
    object: "chat.completion",
    created: chat.created,
    model: chat.resolved.id,
    system_fingerprint: chat.fingerprint,
    choices: choices.map((c, index) => ({
      index,
      message: { role: "assistant", content: c.text, refusal: null },
      finish_reason: c.finishReason ?? "stop",
      logprobs: chat.request.logprobs ? toLogprobs(c.logprobs) : null,
    })),
    usage: {
      prompt_tokens: chat.promptTokens,
      completion_tokens: completionTokens,
      total_tokens: chat.promptTokens + completionTokens,
    },
  };
}

function errorText(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}
