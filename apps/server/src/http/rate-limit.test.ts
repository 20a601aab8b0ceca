import { describe, expect, it } from "vitest";
import { ApiError } from "./errors.ts";
import { RateLimitError, RateLimiter } from "./rate-limit.ts";

function refused(fn: () => unknown): ApiError {
  try {
    fn();
  } catch (err) {
    if (err instanceof ApiError) return err;
    throw err;
  }
  throw new Error("expected a 429");
}

describe("RateLimiter", () => {
  it("when no limit is set, then it is disabled", () => {
    expect(new RateLimiter({}).enabled).toBe(false);
  });

  it("when a key exceeds its requests per minute, then 429 with Retry-After, and the bucket refills with time", () => {
    let now = 0;
    const limiter = new RateLimiter({ keyRequestsPerMinute: 2 }, () => now);
    expect(limiter.acquire("k", "e/p").headers["x-ratelimit-remaining-requests"]).toBe("1");
    expect(limiter.acquire("k", "e/p").headers["x-ratelimit-remaining-requests"]).toBe("0");
    const error = refused(() => limiter.acquire("k", "e/p"));
    expect(error.status).toBe(429);
    expect(error.code).toBe("rate_limit_exceeded");
    expect(error.headers["retry-after"]).toBe("30");
    expect(error.headers["x-ratelimit-limit-requests"]).toBe("2");
    expect(error).toBeInstanceOf(RateLimitError);
    expect(error).toMatchObject({ scope: "key", limit: "requests_per_minute" });
    expect(limiter.acquire("other-key", "e/p")).toBeTruthy();
    now += 30_000;
    expect(limiter.acquire("k", "e/p")).toBeTruthy();
  });

  it("when a project's keys together exceed the project limit, then 429", () => {
    const limiter = new RateLimiter({ projectRequestsPerMinute: 1 }, () => 0);
    limiter.acquire("a", "e/p");
    expect(refused(() => limiter.acquire("b", "e/p"))).toMatchObject({
      status: 429,
      scope: "project",
      limit: "requests_per_minute",
    });
    expect(limiter.acquire("b", "e/other")).toBeTruthy();
  });

  it("when concurrent generations reach the limit, then 429 until one is released", () => {
    const limiter = new RateLimiter({ keyConcurrent: 1 }, () => 0);
    const first = limiter.acquire("k", "e/p");
    const error = refused(() => limiter.acquire("k", "e/p"));
    expect(error.code).toBe("concurrency_limit_exceeded");
    expect(error).toMatchObject({ scope: "key", limit: "concurrency" });
    first.release();
    first.release();
    const second = limiter.acquire("k", "e/p");
    expect(refused(() => limiter.acquire("k", "e/p")).status).toBe(429);
    second.release();
  });
});
