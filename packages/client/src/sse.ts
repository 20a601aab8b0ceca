import { EventSourceParserStream } from "eventsource-parser/stream";
import { APIError } from "./errors.ts";

/** Yields the JSON payload of each `data:` event of an SSE response, until `[DONE]` or the end.
 * An `{"error": ...}` event (an error after the headers went out) is thrown as an APIError.
 * After `[DONE]` the rest of the body is read to its end, as openai-node does, rather than
 * cancelled: the server ends the response there, and a cancelled one reads as aborted. */
export async function* sseJson<T>(response: Response): AsyncGenerator<T> {
  if (!response.body) return;
  const events = response.body
    .pipeThrough(new TextDecoderStream())
    .pipeThrough(new EventSourceParserStream());
  const reader = events.getReader();
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) return;
      if (value.data === "[DONE]") {
        for (;;) if ((await reader.read()).done) return;
      }
      const payload = JSON.parse(value.data) as unknown;
      if (typeof payload === "object" && payload !== null && "error" in payload) {
        throw APIError.from(500, payload, response.headers);
      }
      yield payload as T;
    }
  } finally {
    await reader.cancel().catch(() => {});
  }
}
