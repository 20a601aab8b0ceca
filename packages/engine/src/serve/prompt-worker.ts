/** The prompt encoder's thread: renders and tokenizes large prompts off the caller's thread. */
import { parentPort, workerData } from "node:worker_threads";
import { type ChatFiles, ChatFormat, type ChatMessage, type RenderOptions } from "../model/chat.ts";
import { TokenLimitError } from "../model/tokenizer.ts";

const data = workerData as { files: ChatFiles; eosIds: number[] };
const chat = new ChatFormat(data.files, data.eosIds);

parentPort?.on(
  "message",
  (request: { id: number; messages: ChatMessage[]; options: RenderOptions }) => {
    try {
      const ids = Int32Array.from(chat.encode(request.messages, request.options));
      parentPort?.postMessage({ id: request.id, tokens: ids }, [ids.buffer]);
    } catch (err) {
      parentPort?.postMessage({
        id: request.id,
        error: err instanceof Error ? err.message : String(err),
        ...(err instanceof TokenLimitError ? { atLeast: err.tokens } : {}),
      });
    }
  },
);
