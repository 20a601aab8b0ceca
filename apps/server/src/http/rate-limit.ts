import { randomUUID } from "node:crypto";
import {
  MemoryRateLimits,
  type NamedLimit,
  type RateLimitState,
  type TakeResult,
  UnavailableError,
} from "@arbor/store";
import type { NextFunction, Request, Response } from "express";
import { ApiError } from "./errors.ts";

/** Limits per API key and per project; undefined means unlimited (the embedded default). */
export interface RateLimits {
  keyRequestsPerMinute?: number | undefined;
  projectRequestsPerMinute?: number | undefined;
  keyConcurrent?: number | undefined;
  projectConcurrent?: number | undefined;
}

export type RateLimitScope = "key" | "project";
export type RateLimitKind = "requests_per_minute" | "concurrency";

/** A 429 of the limiter, saying which limit refused. */
export class RateLimitError extends ApiError {
  readonly scope: RateLimitScope;
  readonly limit: RateLimitKind;
  constructor(
    scope: RateLimitScope,
    limit: RateLimitKind,
    message: string,
    options: { code: string; headers: Record<string, string> },
  ) {
    super(429, message, options);
    this.scope = scope;
    this.limit = limit;
  }
}

export interface RateLimiterOptions {
  /** Where the buckets and slots are kept: this process (the default), or a state every
   * replica shares (PostgreSQL, Redis; ADR 39). */
  state?: RateLimitState;
  now?: () => number;
  /** Told why the state could not be reached, and of a slot that could not be renewed or
   * released (it lapses with its lease). */
  onError?: (err: unknown) => void;
}

/**
 * Requests per minute (token buckets) and concurrent generations, per API key and per
 * project. The counts live in a `RateLimitState`; this class turns its answer into headers and
 * 429s, and renews a held slot's lease while its response is open.
 */
export class RateLimiter {
  readonly #limits: RateLimits;
  readonly #state: RateLimitState;
  readonly #now: () => number;
  readonly #onError: (err: unknown) => void;

  constructor(limits: RateLimits, options: RateLimiterOptions = {}) {
    this.#limits = limits;
    this.#state = options.state ?? new MemoryRateLimits();
    this.#now = options.now ?? Date.now;
    this.#onError = options.onError ?? (() => {});
  }

  get enabled(): boolean {
    const l = this.#limits;
    return [
      l.keyRequestsPerMinute,
      l.projectRequestsPerMinute,
      l.keyConcurrent,
      l.projectConcurrent,
    ].some((v) => v !== undefined);
  }

  /** Takes a request slot for the key and project, or throws 429 (503 when the state cannot be
   * reached). Returns the release (once; it settles when the slots are given back). */
  async acquire(
    keyId: string,
    projectId: string,
  ): Promise<{ release: () => Promise<void>; headers: Record<string, string> }> {
    const named = (pairs: [string, number | undefined][]): NamedLimit[] =>
      pairs.flatMap(([name, limit]) => (limit === undefined ? [] : [{ name, limit }]));
    const buckets = named([
      [`key:${keyId}`, this.#limits.keyRequestsPerMinute],
      [`project:${projectId}`, this.#limits.projectRequestsPerMinute],
    ]);
    const slots = named([
      [`key:${keyId}`, this.#limits.keyConcurrent],
      [`project:${projectId}`, this.#limits.projectConcurrent],
    ]);
    const lease = randomUUID();
    let taken: TakeResult;
    try {
      taken = await withTimeout(
        this.#state.take({ buckets, slots, lease, now: this.#now() }),
        TAKE_TIMEOUT_MS,
        "the rate-limit state did not answer",
      );
    } catch (err) {
      // The cause (an address, a driver's message) goes to the log, not to the client.
      this.#onError(err);
      throw new UnavailableError("Rate limits cannot be checked right now; retry shortly.", {
        code: "rate_limits_unavailable",
        retryAfterSeconds: 1,
      });
    }
    const { tokens, refused } = taken;
    const empty = refused?.kind === "bucket" ? refused.index : -1;
    const order = buckets.map((_, i) => i);
    const tightestIndex =
      empty >= 0
        ? empty
        : order.sort((a, b) => tokens[a]! / buckets[a]!.limit - tokens[b]! / buckets[b]!.limit)[0];
    const headers: Record<string, string> = {};
    if (tightestIndex !== undefined) {
      const { limit } = buckets[tightestIndex]!;
      const left = tokens[tightestIndex]!;
      const drawn = empty >= 0 ? 0 : 1;
      headers["x-ratelimit-limit-requests"] = String(limit);
      headers["x-ratelimit-remaining-requests"] = String(Math.max(0, Math.floor(left) - drawn));
      headers["x-ratelimit-reset-requests"] =
        `${Math.ceil(((limit - left + drawn) * 60) / limit)}s`;
    }
    if (refused?.kind === "bucket") {
      const { name, limit } = buckets[refused.index]!;
      const wait = Math.ceil(((1 - tokens[refused.index]!) * 60_000) / limit);
      throw new RateLimitError(
        name.startsWith("key:") ? "key" : "project",
        "requests_per_minute",
        `Rate limit reached: ${limit} requests per minute. Retry after ${Math.ceil(wait / 1000)} s.`,
        {
          code: "rate_limit_exceeded",
          headers: {
            ...headers,
            "retry-after": String(Math.max(1, Math.ceil(wait / 1000))),
            "retry-after-ms": String(wait),
          },
        },
      );
    }
    if (refused?.kind === "slot") {
      const { name, limit } = slots[refused.index]!;
      const scope = name.startsWith("key:") ? "key" : "project";
      throw new RateLimitError(
        scope,
        "concurrency",
        `Too many concurrent generations: at most ${limit} at once for this ${scope}.`,
        {
          code: "concurrency_limit_exceeded",
          headers: { ...headers, "retry-after": "1" },
        },
      );
    }
    const held = slots.map((s) => s.name);
    // A shared state's slots lapse unless renewed: renewed while the response is open.
    const leaseMs = this.#state.leaseMs;
    // Renewals in flight when the response closes are waited for before the release: landing
    // after it, one would hold the slot again for a whole lease.
    const renewing = new Set<Promise<void>>();
    const renewal =
      held.length > 0 && leaseMs !== undefined
        ? setInterval(
            () => {
              const renewed = this.#state.renew(lease, held, this.#now()).catch(this.#onError);
              renewing.add(renewed);
              void renewed.finally(() => renewing.delete(renewed));
            },
            Math.max(1, Math.floor(leaseMs / 3)),
          ).unref()
        : undefined;
    let released = false;
    return {
      headers,
      release: async () => {
        if (released) return;
        released = true;
        clearInterval(renewal);
        await Promise.all(renewing);
        if (held.length > 0) await this.#state.release(lease, held).catch(this.#onError);
      },
    };
  }
}

/** How long a check waits for a shared state (a hung Redis or database) before the request
 * answers 503 instead of waiting with it. */
const TAKE_TIMEOUT_MS = 5000;

function withTimeout<T>(promise: Promise<T>, ms: number, message: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${message} within ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

/** Applies the limiter to a generation route: a slot is held until the response closes.
 * `onRejected` hears of each refusal (for metrics). */
export function rateLimited(
  limiter: RateLimiter,
  onRejected?: (scope: RateLimitScope, limit: RateLimitKind) => void,
) {
  return async (req: Request, res: Response, next: NextFunction) => {
    if (!limiter.enabled) return next();
    // Mounted after `authentication`, which sets both on every path that is not public.
    const { principal, project } = res.locals;
    if (!principal || !project) return next();
    let acquired: Awaited<ReturnType<RateLimiter["acquire"]>>;
    try {
      acquired = await limiter.acquire(principal.keyId, project.id);
    } catch (err) {
      if (err instanceof RateLimitError) onRejected?.(err.scope, err.limit);
      throw err;
    }
    const { release, headers } = acquired;
    // The client may have gone while the check ran (a shared state answers asynchronously).
    if (req.socket.destroyed) {
      await release();
      return;
    }
    for (const [name, value] of Object.entries(headers)) res.setHeader(name, value);
    res.on("close", () => void release());
    next();
  };
}
