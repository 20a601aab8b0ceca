import { EventSourceParserStream } from "eventsource-parser/stream";
import { APIError } from "./errors.ts";

/** How long the end of a stream may take to arrive after its last event before it is cut. */
const CLOSE_GRACE_MS = 2000;

/**
 * Yields the JSON payload of each `data:` event of an SSE response, until `[DONE]`, an item
 * for which `last` is true, or the end. An `{"error": ...}` event (an error after the headers
 * went out) is thrown as an APIError. After the last event the rest of the body is read to its
 * end, as openai-node does, rather than cancelled (a cancelled response reads as aborted in a
 * browser); a server that keeps it open longer than a grace period is cut off.
 */
export async function* sseJson<T>(
  response: Response,
  last?: (item: T) => boolean,
): AsyncGenerator<T> {
  if (!response.body) return;
  const events = response.body
    .pipeThrough(new TextDecoderStream())
    .pipeThrough(new EventSourceParserStream());
  const reader = events.getReader();
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) return;
      if (value.data === "[DONE]") return await drain(reader);
      const payload = JSON.parse(value.data) as unknown;
      if (typeof payload === "object" && payload !== null && "error" in payload) {
        throw APIError.from(500, payload, response.headers);
      }
      yield payload as T;
      if (last?.(payload as T)) return await drain(reader);
    }
  } finally {
    await reader.cancel().catch(() => {});
  }
}

/** Reads to the end of the stream, for at most the grace period (the caller then cancels). */
async function drain(reader: ReadableStreamDefaultReader<unknown>): Promise<void> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<"late">((resolve) => {
    timer = setTimeout(() => resolve("late"), CLOSE_GRACE_MS);
  });
  try {
    for (;;) {
      const read = await Promise.race([reader.read(), late]);
      if (read === "late" || read.done) return;
    }
  } finally {
    clearTimeout(timer);
  }
}
