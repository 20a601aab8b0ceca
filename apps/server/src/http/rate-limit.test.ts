import { randomBytes } from "node:crypto";
import {
  MemoryRateLimits,
  openStore,
  PgRateLimits,
  PostgresSql,
  type RateLimitState,
  RedisRateLimits,
  type Store,
  UnavailableError,
} from "@arbor/store";
import { afterAll, afterEach, beforeAll, describe, expect, it, vi } from "vitest";
import { ApiError } from "./errors.ts";
import { RateLimitError, RateLimiter, type RateLimits } from "./rate-limit.ts";

const PG_URL = process.env.ARBOR_TEST_PG ?? "postgres://postgres@127.0.0.1:5432/test";
const REDIS_URL = process.env.ARBOR_TEST_REDIS ?? "redis://127.0.0.1:6379";

/** Null when the service answers; else why it is skipped (an error under `CI=true`). */
async function reachable(name: string, envVar: string, probe: () => Promise<void>) {
  if (process.env[envVar] === "off") return `${envVar}=off`;
  try {
    await probe();
    return null;
  } catch (err) {
    const reason = `${name} is unreachable (${err instanceof Error ? err.message : String(err)})`;
    if (process.env.CI === "true") throw new Error(`${reason}; CI needs it.`);
    console.log(`[@arbor/server] ${reason}: its rate-limit tests are SKIPPED`);
    return reason;
  }
}

const schema = `arbor_rl_${randomBytes(6).toString("hex")}`;
const pgSkip = await reachable("PostgreSQL", "ARBOR_TEST_PG", async () => {
  const store = await openStore({ databaseUrl: PG_URL, schema });
  await store.close();
});
const redisSkip = await reachable("Redis", "ARBOR_TEST_REDIS", async () => {
  await (await RedisRateLimits.connect(REDIS_URL)).close();
});

async function refused(fn: () => Promise<unknown>): Promise<ApiError> {
  try {
    await fn();
  } catch (err) {
    if (err instanceof ApiError) return err;
    throw err;
  }
  throw new Error("expected a 429");
}

interface Shared {
  name: string;
  skip: boolean;
  /** Two handles on one state: two replicas' views (for memory, one process's). */
  open(): Promise<{ states: [RateLimitState, RateLimitState]; close(): Promise<void> }>;
}

const stores: Store[] = [];
afterAll(async () => {
  for (const store of stores) await store.close();
  if (pgSkip === null) {
    const admin = new PostgresSql({ connectionString: PG_URL });
    await admin.exec(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
    await admin.close();
  }
});

const backends: Shared[] = [
  {
    name: "memory",
    skip: false,
    async open() {
      const state = new MemoryRateLimits();
      return { states: [state, state], close: async () => {} };
    },
  },
  {
    name: "postgres",
    skip: pgSkip !== null,
    async open() {
      const [a, b] = [
        await openStore({ databaseUrl: PG_URL, schema }),
        await openStore({ databaseUrl: PG_URL, schema }),
      ];
      stores.push(a, b);
      return {
        states: [new PgRateLimits(a.sql as PostgresSql), new PgRateLimits(b.sql as PostgresSql)],
        close: async () => {},
      };
    },
  },
  {
    name: "redis",
    skip: redisSkip !== null,
    async open() {
      const namespace = `test-${randomBytes(6).toString("hex")}`;
      const a = await RedisRateLimits.connect(REDIS_URL, { namespace });
      const b = await RedisRateLimits.connect(REDIS_URL, { namespace });
      return {
        states: [a, b],
        close: async () => {
          await a.close();
          await b.close();
        },
      };
    },
  },
];

for (const backend of backends) {
  describe.skipIf(backend.skip)(`RateLimiter [${backend.name}]`, () => {
    let states: [RateLimitState, RateLimitState];
    let close: () => Promise<void>;
    beforeAll(async () => {
      ({ states, close } = await backend.open());
    });
    afterAll(() => close());

    /** One limiter per replica, on the shared state, with the test's clock. Keys and projects
     * are fresh per test, so the tests of one file never meet in the shared state. */
    let now = 0;
    const limiters = (limits: RateLimits) => {
      now = 0;
      const tag = randomBytes(4).toString("hex");
      const make = (state: RateLimitState) => new RateLimiter(limits, { state, now: () => now });
      return { a: make(states[0]), b: make(states[1]), k: (n: string) => `${n}-${tag}` };
    };

    it("when no limit is set, then it is disabled", () => {
      expect(new RateLimiter({}, { state: states[0] }).enabled).toBe(false);
    });

    it("when a key exceeds its requests per minute, then 429 with Retry-After, and the bucket refills with time", async () => {
      const { a: limiter, k } = limiters({ keyRequestsPerMinute: 2 });
      expect(
        (await limiter.acquire(k("k"), k("e/p"))).headers["x-ratelimit-remaining-requests"],
      ).toBe("1");
      expect(
        (await limiter.acquire(k("k"), k("e/p"))).headers["x-ratelimit-remaining-requests"],
      ).toBe("0");
      const error = await refused(() => limiter.acquire(k("k"), k("e/p")));
      expect(error.status).toBe(429);
      expect(error.code).toBe("rate_limit_exceeded");
      expect(error.headers["retry-after"]).toBe("30");
      expect(error.headers["retry-after-ms"]).toBe("30000");
      expect(error.headers["x-ratelimit-limit-requests"]).toBe("2");
      expect(error.headers["x-ratelimit-remaining-requests"]).toBe("0");
      expect(error.headers["x-ratelimit-reset-requests"]).toBe("60s");
      expect(error).toBeInstanceOf(RateLimitError);
      expect(error).toMatchObject({ scope: "key", limit: "requests_per_minute" });
      expect(await limiter.acquire(k("other-key"), k("e/p"))).toBeTruthy();
      now += 30_000;
      expect(await limiter.acquire(k("k"), k("e/p"))).toBeTruthy();
    });

    it("when a project's keys together exceed the project limit, then 429", async () => {
      const { a: limiter, k } = limiters({ projectRequestsPerMinute: 1 });
      await limiter.acquire(k("a"), k("e/p"));
      expect(await refused(() => limiter.acquire(k("b"), k("e/p")))).toMatchObject({
        status: 429,
        scope: "project",
        limit: "requests_per_minute",
      });
      expect(await limiter.acquire(k("b"), k("e/other"))).toBeTruthy();
    });

    it("when both limits apply, then the headers name the tightest", async () => {
      const { a: limiter, k } = limiters({ keyRequestsPerMinute: 10, projectRequestsPerMinute: 3 });
      // Both full: equally tight, the key's is named.
      expect((await limiter.acquire(k("k"), k("e/p"))).headers).toEqual({
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "6s",
      });
      expect((await limiter.acquire(k("k"), k("e/p"))).headers).toEqual({
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "40s",
      });
    });

    it("when concurrent generations reach the limit, then 429 until one is released", async () => {
      const { a: limiter, k } = limiters({ keyConcurrent: 1 });
      const first = await limiter.acquire(k("k"), k("e/p"));
      const error = await refused(() => limiter.acquire(k("k"), k("e/p")));
      expect(error.code).toBe("concurrency_limit_exceeded");
      expect(error.headers["retry-after"]).toBe("1");
      expect(error).toMatchObject({ scope: "key", limit: "concurrency" });
      await first.release();
      await first.release();
      const second = await limiter.acquire(k("k"), k("e/p"));
      expect((await refused(() => limiter.acquire(k("k"), k("e/p")))).status).toBe(429);
      await second.release();
    });

    if (backend.name === "memory") return;

    it("when two replicas share the state, then N requests per minute hold across them together", async () => {
      const { a, b, k } = limiters({ keyRequestsPerMinute: 3, projectRequestsPerMinute: 100 });
      const outcomes: (string | number)[] = [];
      for (let i = 0; i < 8; i++) {
        const replica = i % 2 === 0 ? a : b;
        try {
          outcomes.push(
            (await replica.acquire(k("key"), k("e/p"))).headers["x-ratelimit-remaining-requests"]!,
          );
        } catch (err) {
          outcomes.push((err as ApiError).status);
        }
      }
      expect(outcomes).toEqual(["2", "1", "0", 429, 429, 429, 429, 429]);
      now += 20_000;
      expect(await b.acquire(k("key"), k("e/p"))).toBeTruthy();
      expect((await refused(() => a.acquire(k("key"), k("e/p")))).status).toBe(429);
    });

    it("when two replicas share the state, then the concurrency limit holds across them, and a slot released on one frees it for the other", async () => {
      const { a, b, k } = limiters({ projectConcurrent: 2 });
      const one = await a.acquire(k("k1"), k("e/p"));
      await b.acquire(k("k2"), k("e/p"));
      expect(await refused(() => a.acquire(k("k3"), k("e/p")))).toMatchObject({
        status: 429,
        scope: "project",
        limit: "concurrency",
      });
      expect((await refused(() => b.acquire(k("k3"), k("e/p")))).status).toBe(429);
      await one.release();
      expect(await b.acquire(k("k3"), k("e/p"))).toBeTruthy();
    });

    it("when a slot is held, then its lease is renewed every third of it until the release", async () => {
      vi.useFakeTimers({ toFake: ["setInterval", "clearInterval"] });
      try {
        const state = states[0];
        const renew = vi.spyOn(state, "renew");
        const limiter = new RateLimiter({ keyConcurrent: 1 }, { state, now: () => 5 });
        const held = await limiter.acquire(`k-${randomBytes(4).toString("hex")}`, "e/p");
        expect(renew).not.toHaveBeenCalled();
        vi.advanceTimersByTime(state.leaseMs! / 3);
        expect(renew).toHaveBeenCalledTimes(1);
        vi.advanceTimersByTime(state.leaseMs!);
        expect(renew).toHaveBeenCalledTimes(4);
        await held.release();
        vi.advanceTimersByTime(state.leaseMs!);
        expect(renew).toHaveBeenCalledTimes(4);
        renew.mockRestore();
      } finally {
        vi.useRealTimers();
      }
    });
  });
}

describe("RateLimiter, state unreachable", () => {
  afterEach(() => vi.restoreAllMocks());

  it("when the shared state cannot answer, then unavailable (a 503), not a pass", async () => {
    const state = new MemoryRateLimits();
    vi.spyOn(state, "take").mockRejectedValue(new Error("connection refused"));
    const causes: unknown[] = [];
    const acquiring = new RateLimiter(
      { keyRequestsPerMinute: 1 },
      { state, onError: (err) => causes.push(err) },
    ).acquire("k", "e/p");
    await expect(acquiring).rejects.toBeInstanceOf(UnavailableError);
    await expect(acquiring).rejects.toMatchObject({
      kind: "unavailable",
      code: "rate_limits_unavailable",
      message: "Rate limits cannot be checked right now; retry shortly.",
    });
    // The cause is logged, not sent.
    expect(causes).toEqual([new Error("connection refused")]);
  });
});
