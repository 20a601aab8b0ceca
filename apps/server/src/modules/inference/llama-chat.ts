import { InvalidInputError } from "@arbor/store";
import { type ChatRequest, toGenerateRequest, toolRequestOf, unsupported } from "./chat.ts";
import { checkSupported, LlamaUnsupportedError } from "./llama-cpp.ts";
import type { ResolvedModel } from "./models.ts";
import { type ChatBackend, generationEvents, type PreparedChat } from "./service.ts";

/** A user-supplied GGUF on llama.cpp: its own tokenizer counts the prompt; what it cannot
 * honour is a 400 naming the field. */
export const llamaChatBackend: ChatBackend<Extract<ResolvedModel, { kind: "llama" }>> = {
  async prepare(resolved, body: ChatRequest): Promise<PreparedChat> {
    const request = toGenerateRequest(body);
    // llama.cpp's chat wrappers render no tools here, and its replies are not read for calls.
    if (toolRequestOf(body)) throw unsupported("tools");
    request.messages?.forEach((message, i) => {
      if (message.toolCalls) throw unsupported(`messages[${i}].tool_calls`);
    });
    try {
      checkSupported(request);
    } catch (err) {
      if (err instanceof LlamaUnsupportedError) throw unsupported(err.field);
      throw err;
    }
    const { backend } = resolved;
    await backend.load();
    const promptTokens = await backend.countPromptTokens(request.messages ?? []);
    if (promptTokens >= backend.contextLength) {
      throw new InvalidInputError(
        `The messages take ${promptTokens} tokens; this model's context is ${backend.contextLength} tokens.`,
        { param: "messages", code: "context_length_exceeded" },
      );
    }
    return {
      promptTokens,
      start: async (signal) => generationEvents(backend.generate(request, { signal })),
    };
  },
};
