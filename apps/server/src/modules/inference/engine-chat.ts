import { PromptError } from "@arbor/engine/model";
import { ContextLengthError } from "@arbor/engine/serve";
import { type BlobStore, InvalidInputError } from "@arbor/store";
import { type ChatRequest, toGenerateRequest, toolRequestOf } from "./chat.ts";
import { CheckpointGoneError, type EngineHost } from "./engines.ts";
import { modelNotFound, type ResolvedModel } from "./models.ts";
import { type ChatBackend, generationEvents, type PreparedChat } from "./service.ts";
import { engineTools, readToolCalls } from "./tool-calls.ts";

/** The embedded engine: the base model's thread, with a checkpoint's adapter when trained. */
export class EngineChatBackend implements ChatBackend<Extract<ResolvedModel, { kind: "engine" }>> {
  readonly #engines: EngineHost;
  /** Where trained checkpoints' adapter files are. */
  readonly #blobs: BlobStore;

  constructor(engines: EngineHost, blobs: BlobStore) {
    this.#engines = engines;
    this.#blobs = blobs;
  }

  /** Renders and counts the prompt on the engine's thread (refusing what cannot fit), checks
   * the response format, and loads the adapter: all before any response is started. */
  async prepare(
    resolved: Extract<ResolvedModel, { kind: "engine" }>,
    body: ChatRequest,
  ): Promise<PreparedChat> {
    const { messages = [], ...request } = toGenerateRequest(body);
    const engine = await this.#engines.engine(resolved.baseId);
    const tools = engineTools(
      engine.info.toolCallFormat,
      toolRequestOf(body),
      request.responseFormat,
    );
    if (tools.schema) request.responseFormat = { type: "json_schema", schema: tools.schema };
    if (tools.toolCalls) request.toolCalls = tools.toolCalls;
    const prompt = await engine.encodeChat(messages, tools.prompt).catch((err: unknown) => {
      if (err instanceof ContextLengthError) {
        throw new InvalidInputError(err.message, {
          param: "messages",
          code: "context_length_exceeded",
        });
      }
      if (err instanceof PromptError) {
        throw new InvalidInputError(`The messages cannot be rendered: ${err.message}`, {
          param: "messages",
        });
      }
      throw err;
    });
    // The adapter is read only for a request that can run.
    const adapter = resolved.checkpoint
      ? await this.#engines
          .adapter(resolved.baseId, resolved.checkpoint, this.#blobs)
          .catch((err: unknown) => {
            if (err instanceof CheckpointGoneError) throw modelNotFound(resolved.id);
            throw err;
          })
      : null;
    return {
      promptTokens: prompt.length,
      start: async (signal) => {
        const events = generationEvents(
          engine.generate({ ...request, prompt, adapter }, { signal }),
        );
        return tools.reading ? readToolCalls(events, tools.reading) : events;
      },
    };
  }
}
