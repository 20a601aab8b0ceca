import { randomBytes } from "node:crypto";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  MemoryRateLimits,
  PgRateLimits,
  type PostgresSql,
  type RateLimitState,
  RedisRateLimits,
  type TakeRequest,
} from "../src/index.ts";
import { pgSkipReason, REDIS_URL, redisSkipReason, StoreContext } from "./helpers.ts";

const LEASE_MS = 30_000;

interface Backend {
  name: string;
  skip: boolean;
  /** Two handles on one shared state (two replicas); for memory, the same one twice. `kept`
   * says whether the state still holds a row for a name, where it can be seen. */
  open(): Promise<{
    a: RateLimitState;
    b: RateLimitState;
    close(): Promise<void>;
    kept?: (name: string) => Promise<boolean>;
  }>;
}

const backends: Backend[] = [
  {
    name: "memory",
    skip: false,
    async open() {
      const state = new MemoryRateLimits();
      return { a: state, b: state, close: async () => {} };
    },
  },
  {
    name: "postgres",
    skip: pgSkipReason !== null,
    async open() {
      const ctx = new StoreContext("postgres");
      await ctx.setup();
      const other = await ctx.openAnother();
      return {
        a: new PgRateLimits(ctx.store.sql as PostgresSql, { leaseMs: LEASE_MS }),
        b: new PgRateLimits(other.sql as PostgresSql, { leaseMs: LEASE_MS }),
        close: () => ctx.teardown(),
        kept: async (name) =>
          (await ctx.store.sql.one("SELECT 1 AS kept FROM rate_buckets WHERE name = $1", [
            name,
          ])) !== undefined,
      };
    },
  },
  {
    name: "redis",
    skip: redisSkipReason !== null,
    async open() {
      const namespace = `test-${randomBytes(6).toString("hex")}`;
      const a = await RedisRateLimits.connect(REDIS_URL, { namespace, leaseMs: LEASE_MS });
      const b = await RedisRateLimits.connect(REDIS_URL, { namespace, leaseMs: LEASE_MS });
      return {
        a,
        b,
        close: async () => {
          await a.close();
          await b.close();
        },
      };
    },
  },
];

let serial = 0;
/** Names unique to one test, so tests of one file share a state without meeting. */
const fresh = () => `t${++serial}-${randomBytes(3).toString("hex")}`;

for (const backend of backends) {
  describe.skipIf(backend.skip)(`rate limit state [${backend.name}]`, () => {
    let a: RateLimitState;
    let b: RateLimitState;
    let close: () => Promise<void>;
    let kept: ((name: string) => Promise<boolean>) | undefined;
    beforeAll(async () => {
      ({ a, b, close, kept } = await backend.open());
    });
    afterAll(() => close());

    const rpm = (name: string, limit: number, now: number, lease = fresh()): TakeRequest => ({
      buckets: [{ name, limit }],
      slots: [],
      lease,
      now,
    });

    it("when a bucket is drawn from, then it refuses at empty and refills continuously", async () => {
      const key = `key:${fresh()}`;
      expect(await a.take(rpm(key, 2, 0))).toEqual({ tokens: [2], refused: null });
      expect(await a.take(rpm(key, 2, 0))).toEqual({ tokens: [1], refused: null });
      expect(await a.take(rpm(key, 2, 0))).toEqual({
        tokens: [0],
        refused: { kind: "bucket", index: 0 },
      });
      // Half a minute refills one of two a minute; a clock that went back refills nothing.
      expect((await a.take(rpm(key, 2, 15_000))).tokens[0]).toBeCloseTo(0.5, 9);
      expect((await a.take(rpm(key, 2, 10_000))).refused).not.toBeNull();
      expect(await a.take(rpm(key, 2, 30_000))).toEqual({ tokens: [1], refused: null });
      // A long idle time refills up to the limit, not past it.
      expect((await a.take(rpm(key, 2, 10 * 60_000))).tokens).toEqual([2]);
    });

    it("when one of two buckets is empty, then nothing is taken from either", async () => {
      const key = `key:${fresh()}`;
      const project = `project:${fresh()}`;
      const both = (now: number): TakeRequest => ({
        buckets: [
          { name: key, limit: 5 },
          { name: project, limit: 1 },
        ],
        slots: [],
        lease: fresh(),
        now,
      });
      expect((await a.take(both(0))).refused).toBeNull();
      expect(await a.take(both(0))).toEqual({
        tokens: [4, 0],
        refused: { kind: "bucket", index: 1 },
      });
      expect((await a.take(rpm(key, 5, 0))).tokens).toEqual([4]);
    });

    it("when slots are full, then 'slot' until one is released, and no token is drawn meanwhile", async () => {
      const key = `key:${fresh()}`;
      const take = (lease: string) =>
        a.take({
          buckets: [{ name: key, limit: 10 }],
          slots: [{ name: key, limit: 2 }],
          lease,
          now: 0,
        });
      expect((await take("l1")).refused).toBeNull();
      expect((await take("l2")).refused).toBeNull();
      expect(await take("l3")).toEqual({ tokens: [8], refused: { kind: "slot", index: 0 } });
      await a.release("l1", [key]);
      await a.release("l1", [key]);
      expect((await take("l4")).refused).toBeNull();
      expect((await take("l5")).refused).toEqual({ kind: "slot", index: 0 });
    });

    it("when pruned, then a bucket in use keeps its count, and one idle for a minute is full again", async () => {
      const busy = `key:${fresh()}`;
      const idle = `key:${fresh()}`;
      await a.take(rpm(idle, 1, 0));
      expect((await a.take(rpm(busy, 2, 30_000))).refused).toBeNull();
      expect((await a.take(rpm(busy, 2, 30_000))).refused).toBeNull();
      if (kept) expect(await kept(idle)).toBe(true);
      await a.prune(61_000);
      if (kept) {
        expect(await kept(idle)).toBe(false);
        expect(await kept(busy)).toBe(true);
      }
      // busy was drawn empty 31 s ago: about one token back, not two.
      expect((await b.take(rpm(busy, 2, 61_000))).tokens[0]).toBeCloseTo(1.0333, 3);
      expect((await b.take(rpm(idle, 1, 61_000))).tokens).toEqual([1]);
    });

    if (backend.name === "memory") return;

    it("when two replicas draw from one bucket, then N per minute holds across them together", async () => {
      const project = `project:${fresh()}`;
      const outcomes: boolean[] = [];
      for (let i = 0; i < 10; i++) {
        const replica = i % 2 === 0 ? a : b;
        outcomes.push((await replica.take(rpm(project, 4, 1_000))).refused === null);
      }
      expect(outcomes).toEqual([true, true, true, true, false, false, false, false, false, false]);
      // A minute later both see it full again.
      expect((await b.take(rpm(project, 4, 61_000))).tokens).toEqual([4]);
    });

    it("when many checks race on two replicas, then exactly the limit is taken", async () => {
      const key = `key:${fresh()}`;
      const results = await Promise.all(
        Array.from({ length: 24 }, (_, i) =>
          (i % 2 === 0 ? a : b).take({
            buckets: [{ name: key, limit: 7 }],
            slots: [{ name: key, limit: 5 }],
            lease: `race-${i}`,
            now: 5_000,
          }),
        ),
      );
      expect(results.filter((r) => r.refused === null)).toHaveLength(5);
      expect(results.filter((r) => r.refused?.kind === "slot")).toHaveLength(19);
      const slotsOnly = `key:${fresh()}`;
      const buckets = await Promise.all(
        Array.from({ length: 24 }, (_, i) => (i % 2 === 0 ? a : b).take(rpm(slotsOnly, 7, 5_000))),
      );
      expect(buckets.filter((r) => r.refused === null)).toHaveLength(7);
    });

    it("when a replica dies holding slots, then they lapse after the lease; renewed ones stay", async () => {
      const project = `project:${fresh()}`;
      const take = (state: RateLimitState, lease: string, now: number) =>
        state.take({ buckets: [], slots: [{ name: project, limit: 2 }], lease, now });
      expect((await take(a, "dies", 0)).refused).toBeNull();
      expect((await take(a, "lives", 0)).refused).toBeNull();
      expect((await take(b, "waits", 20_000)).refused).toEqual({ kind: "slot", index: 0 });
      // "lives" is renewed by its holder; "dies" is not, and lapses at 30 s.
      await a.renew("lives", [project], 20_000);
      expect((await take(b, "waits", LEASE_MS - 1)).refused).toEqual({ kind: "slot", index: 0 });
      expect((await take(b, "waits", LEASE_MS)).refused).toBeNull();
      expect((await take(b, "again", LEASE_MS + 1)).refused).toEqual({ kind: "slot", index: 0 });
      // Released on the other replica than the one that took it: shared.
      await b.release("lives", [project]);
      expect((await take(a, "again", LEASE_MS + 1)).refused).toBeNull();
    });

    it("when names hold quotes, commas, braces or backslashes, then they are kept apart", async () => {
      const odd = [`project:${fresh()}/a,"b"`, `project:${fresh()}/{c}\\d`];
      for (const name of odd) {
        expect((await a.take(rpm(name, 1, 0))).refused).toBeNull();
        expect((await b.take(rpm(name, 1, 0))).refused).toEqual({ kind: "bucket", index: 0 });
      }
    });

    it("when pinged, then it answers", async () => {
      await expect(a.ping()).resolves.toBeUndefined();
    });
  });
}
