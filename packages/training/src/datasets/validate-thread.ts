/** The dataset validator's thread: checks large uploads off the server's thread. */
import { parentPort } from "node:worker_threads";
import { InvalidDatasetError, validateSftJsonl } from "./jsonl.ts";

parentPort?.on("message", ({ id, text }: { id: number; text: string }) => {
  try {
    parentPort?.postMessage({ id, lines: validateSftJsonl(text).lines });
  } catch (err) {
    if (err instanceof InvalidDatasetError) {
      parentPort?.postMessage({ id, invalid: { line: err.line, reason: err.reason } });
    } else {
      parentPort?.postMessage({ id, error: err instanceof Error ? err.message : String(err) });
    }
  }
});
