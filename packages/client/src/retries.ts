import { APIConnectionError, APIConnectionTimeoutError, APIUserAbortError } from "./errors.ts";

export interface RetryOptions {
  /** Retries after the first attempt; 2 by default, as openai-node. */
  maxRetries: number;
  /** Milliseconds each attempt may wait for the answer's headers (none when absent). */
  timeout?: number;
  fetch: (request: Request) => Promise<Response>;
  sleep: (ms: number) => Promise<void>;
  random: () => number;
}

/** POSTs that read or merge by id, so a repeat is harmless. Other POSTs are retried only when
 * the caller sends an `Idempotency-Key`. */
const idempotentPosts = new Set(["/calls/usage", "/calls/query", "/call/end", "/calls/delete"]);
const safeMethods = new Set(["GET", "HEAD", "OPTIONS", "PUT", "DELETE"]);
const maxRetryAfterMs = 60_000;

export function isRetryableRequest(request: Request): boolean {
  if (safeMethods.has(request.method)) return true;
  if (request.headers.has("idempotency-key")) return true;
  return request.method === "POST" && idempotentPosts.has(new URL(request.url).pathname);
}

/** openai-node's rule: `x-should-retry` wins; then 408, 409, 429 and 5xx. */
export function shouldRetryResponse(response: Response): boolean {
  const explicit = response.headers.get("x-should-retry");
  if (explicit === "true") return true;
  if (explicit === "false") return false;
  const s = response.status;
  return s === 408 || s === 409 || s === 429 || s >= 500;
}

/** `retry-after-ms`, then `retry-after` (seconds or an HTTP date), capped at 60 s; otherwise
 * exponential backoff from 0.5 s to 8 s with up to 25% jitter. */
export function retryDelayMs(
  response: Response | undefined,
  retriesDone: number,
  random: () => number,
  now: number = Date.now(),
): number {
  const headers = response?.headers;
  const ms = Number(headers?.get("retry-after-ms"));
  if (headers?.has("retry-after-ms") && Number.isFinite(ms) && ms >= 0 && ms <= maxRetryAfterMs)
    return ms;
  const after = headers?.get("retry-after");
  if (after) {
    const seconds = Number(after);
    const fromHeader = Number.isFinite(seconds) ? seconds * 1000 : Date.parse(after) - now;
    if (Number.isFinite(fromHeader) && fromHeader >= 0 && fromHeader <= maxRetryAfterMs)
      return fromHeader;
  }
  const base = Math.min(0.5 * 2 ** retriesDone, 8);
  return base * (1 - random() * 0.25) * 1000;
}

/** A fetch that retries per openai-node's policy. Each attempt sends a clone, so a body can be
 * sent again, and has `timeout` ms to get its answer's headers (a timeout is retried as a
 * connection error). */
export function retryingFetch(options: RetryOptions): (request: Request) => Promise<Response> {
  return async (request) => {
    const retryable = options.maxRetries > 0 && isRetryableRequest(request);
    for (let retriesDone = 0; ; retriesDone++) {
      const canRetry = retryable && retriesDone < options.maxRetries;
      let response: Response;
      try {
        response = await attempt(options, canRetry ? request.clone() : request);
      } catch (err) {
        if (request.signal.aborted) throw new APIUserAbortError();
        if (!canRetry) {
          if (err instanceof TimedOut) throw new APIConnectionTimeoutError(err.ms);
          throw new APIConnectionError(err);
        }
        await options.sleep(retryDelayMs(undefined, retriesDone, options.random));
        continue;
      }
      if (!canRetry || !shouldRetryResponse(response)) return response;
      await response.body?.cancel();
      await options.sleep(retryDelayMs(response, retriesDone, options.random));
    }
  };
}

class TimedOut extends Error {
  readonly ms: number;
  constructor(ms: number) {
    super(`timed out after ${ms} ms`);
    this.ms = ms;
  }
}

/** One fetch, aborted when no answer's headers came within the timeout. */
async function attempt(options: RetryOptions, request: Request): Promise<Response> {
  const ms = options.timeout;
  if (ms === undefined || !Number.isFinite(ms)) return options.fetch(request);
  const controller = new AbortController();
  const unlink = follow(request.signal, controller);
  const handle = setTimeout(() => controller.abort(new TimedOut(ms)), ms);
  try {
    return await options.fetch(new Request(request, { signal: controller.signal }));
  } catch (err) {
    if (controller.signal.aborted && !request.signal.aborted) throw controller.signal.reason;
    throw err;
  } finally {
    clearTimeout(handle);
    unlink();
  }
}

/** Aborts `controller` when `signal` aborts; returns the function that stops following, so
 * a link lasts exactly as long as the attempt or stream that needs it. */
export function follow(signal: AbortSignal | undefined, controller: AbortController): () => void {
  if (!signal) return () => {};
  if (signal.aborted) {
    controller.abort(signal.reason);
    return () => {};
  }
  const abort = () => controller.abort(signal.reason);
  signal.addEventListener("abort", abort, { once: true });
  return () => signal.removeEventListener("abort", abort);
}
