import type { Response } from "express";

/** Server-sent events on an Express response: `data: <json>` frames, flushed as written. */
export class SseWriter {
  readonly #res: Response;
  #open = true;

  constructor(res: Response) {
    this.#res = res;
    res.status(200);
    res.setHeader("content-type", "text/event-stream; charset=utf-8");
    res.setHeader("cache-control", "no-cache, no-transform");
    res.setHeader("connection", "keep-alive");
    res.setHeader("x-accel-buffering", "no");
    res.flushHeaders();
    res.on("close", () => {
      this.#open = false;
    });
  }

  /** False once the client went away (also before this writer was made). */
  get open(): boolean {
    return this.#open && !this.#res.writableEnded && !this.#res.destroyed;
  }

  /** A `data:` frame, after an `event:` line when `event` names it (the Responses API's). */
  send(data: unknown, event?: string): void {
    if (!this.open) return;
    const named = event ? `event: ${event}\n` : "";
    this.#res.write(`${named}data: ${typeof data === "string" ? data : JSON.stringify(data)}\n\n`);
  }

  end(): void {
    if (!this.#res.writableEnded) this.#res.end();
  }
}

/** An AbortSignal that fires when the client disconnects before the response finished. */
export function disconnectSignal(res: Response): AbortSignal {
  const controller = new AbortController();
  res.on("close", () => {
    if (!res.writableFinished) controller.abort(new Error("client disconnected"));
  });
  return controller.signal;
}

/**
 * Streams `events` as SSE, then `[DONE]`. The headers go out with the first event, so an error
 * before it (an upstream's refusal) is an ordinary error response; an error after it reaches the
 * error handler with the headers sent, which writes it as an `{"error": …}` event and ends the
 * stream. A client that leaves stops the reading (and so the run behind `events`).
 */
export async function streamSse(
  res: Response,
  events: AsyncIterable<unknown>,
  options: { done?: boolean; eventName?: (event: unknown) => string | undefined } = {},
): Promise<void> {
  let sse: SseWriter | undefined;
  for await (const event of events) {
    sse ??= new SseWriter(res);
    if (!sse.open) break;
    sse.send(event, options.eventName?.(event));
  }
  sse ??= new SseWriter(res);
  if (options.done ?? true) sse.send("[DONE]");
  sse.end();
}
