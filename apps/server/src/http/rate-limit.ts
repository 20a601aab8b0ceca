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

/** A token bucket: `limit` requests a minute, refilled continuously. */
class Bucket {
  readonly limit: number;
  tokens: number;
  updated: number;
  constructor(limit: number, now: number) {
    this.limit = limit;
    this.tokens = limit;
    this.updated = now;
  }
  refill(now: number): void {
    this.tokens = Math.min(this.limit, this.tokens + ((now - this.updated) * this.limit) / 60_000);
    this.updated = now;
  }
  /** Milliseconds until one token is back. */
  waitMs(): number {
    return this.tokens >= 1 ? 0 : Math.ceil(((1 - this.tokens) * 60_000) / this.limit);
  }
}

/** In-process limits: each server replica enforces its own share. */
export class RateLimiter {
  readonly #limits: RateLimits;
  readonly #now: () => number;
  readonly #buckets = new Map<string, Bucket>();
  readonly #inFlight = new Map<string, number>();

  constructor(limits: RateLimits, now: () => number = Date.now) {
    this.#limits = limits;
    this.#now = now;
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

  /** Takes a request slot for the key and project, or throws 429. Returns the release. */
  acquire(
    keyId: string,
    projectId: string,
  ): { release: () => void; headers: Record<string, string> } {
    const now = this.#now();
    const checks: [string, number | undefined][] = [
      [`key:${keyId}`, this.#limits.keyRequestsPerMinute],
      [`project:${projectId}`, this.#limits.projectRequestsPerMinute],
    ];
    const buckets = checks.flatMap(([name, limit]) =>
      limit === undefined ? [] : [this.#bucket(name, limit, now)],
    );
    for (const bucket of buckets) bucket.refill(now);
    const empty = buckets.find((b) => b.tokens < 1);
    const tightest = empty ?? buckets.sort((a, b) => a.tokens / a.limit - b.tokens / b.limit)[0];
    const headers: Record<string, string> = tightest
      ? {
          "x-ratelimit-limit-requests": String(tightest.limit),
          "x-ratelimit-remaining-requests": String(
            Math.max(0, Math.floor(tightest.tokens) - (empty ? 0 : 1)),
          ),
          "x-ratelimit-reset-requests": `${Math.ceil(((tightest.limit - tightest.tokens + (empty ? 0 : 1)) * 60) / tightest.limit)}s`,
        }
      : {};
    if (empty) {
      const wait = empty.waitMs();
      throw new RateLimitError(
        this.#buckets.get(`key:${keyId}`) === empty ? "key" : "project",
        "requests_per_minute",
        `Rate limit reached: ${empty.limit} requests per minute. Retry after ${Math.ceil(wait / 1000)} s.`,
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
    const slots: [string, number | undefined][] = [
      [`key:${keyId}`, this.#limits.keyConcurrent],
      [`project:${projectId}`, this.#limits.projectConcurrent],
    ];
    for (const [name, limit] of slots) {
      if (limit !== undefined && (this.#inFlight.get(name) ?? 0) >= limit) {
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
    }
    for (const bucket of buckets) bucket.tokens -= 1;
    const held = slots.filter(([, limit]) => limit !== undefined).map(([name]) => name);
    for (const name of held) this.#inFlight.set(name, (this.#inFlight.get(name) ?? 0) + 1);
    let released = false;
    return {
      headers,
      release: () => {
        if (released) return;
        released = true;
        for (const name of held) {
          const left = (this.#inFlight.get(name) ?? 1) - 1;
          if (left <= 0) this.#inFlight.delete(name);
          else this.#inFlight.set(name, left);
        }
      },
    };
  }

  #bucket(name: string, limit: number, now: number): Bucket {
    let bucket = this.#buckets.get(name);
    if (!bucket) {
      bucket = new Bucket(limit, now);
      this.#buckets.set(name, bucket);
    }
    return bucket;
  }
}

/** Applies the limiter to a generation route: a slot is held until the response closes.
 * `onRejected` hears of each refusal (for metrics). */
export function rateLimited(
  limiter: RateLimiter,
  onRejected?: (scope: RateLimitScope, limit: RateLimitKind) => void,
) {
  return (_req: Request, res: Response, next: NextFunction) => {
    if (!limiter.enabled) return next();
    // Mounted after `authentication`, which sets both on every path that is not public.
    const { principal, project } = res.locals;
    if (!principal || !project) return next();
    let acquired: ReturnType<RateLimiter["acquire"]>;
    try {
      acquired = limiter.acquire(principal.keyId, project.id);
    } catch (err) {
      if (err instanceof RateLimitError) onRejected?.(err.scope, err.limit);
      throw err;
    }
    const { release, headers } = acquired;
    for (const [name, value] of Object.entries(headers)) res.setHeader(name, value);
    res.on("close", release);
    next();
  };
}
