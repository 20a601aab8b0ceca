/** The prompt encoder's thread: renders and tokenizes large prompts off the caller's thread. */
import { parentPort, workerData } from "node:worker_threads";
import { type ChatMessage, renderChat } from "./chat.ts";
import { Tokenizer } from "./tokenizer.ts";

const tokenizer = Tokenizer.fromJson((workerData as { tokenizer: unknown }).tokenizer);

parentPort?.on(
  "message",
  (request: { id: number; messages: ChatMessage[]; addGenerationPrompt: boolean }) => {
    try {
      const { tokens } = renderChat(tokenizer, request.messages, {
        addGenerationPrompt: request.addGenerationPrompt,
      });
      const ids = Int32Array.from(tokens);
      parentPort?.postMessage({ id: request.id, tokens: ids }, [ids.buffer]);
    } catch (err) {
      parentPort?.postMessage({
        id: request.id,
        error: err instanceof Error ? err.message : String(err),
      });
    }
  },
);
