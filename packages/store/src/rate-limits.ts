import { createHash } from "node:crypto";
import { num, numOrNull, rowSchema, str } from "./rows.ts";
import type { PostgresSql, Sql } from "./sql.ts";

/**
 * The state of rate limits (ADR 39): token buckets of requests per minute and concurrency slots,
 * each under a name (`key:<id>`, `project:<id>`). The rules are the same on every backend; what
 * differs is who shares the state: one process (`MemoryRateLimits`), or every replica on one
 * PostgreSQL (`PgRateLimits`) or one Redis (`RedisRateLimits`). The HTTP layer (the server's
 * `RateLimiter`) turns a refusal into a 429 with its headers.
 */

/** A limit under a name: a bucket of `limit` requests a minute, or `limit` concurrent slots. */
export interface NamedLimit {
  name: string;
  limit: number;
}

export interface TakeRequest {
  /** Each must hold a whole token (refilled continuously, `limit` a minute, up to `limit`). */
  buckets: readonly NamedLimit[];
  /** Each must have fewer than `limit` slots held. */
  slots: readonly NamedLimit[];
  /** Names the slots this request takes: renewed and released by it. */
  lease: string;
  now: number;
}

export interface TakeResult {
  /** Each bucket's tokens after refilling, before this request took one, in `buckets`' order. */
  tokens: number[];
  /** What refused: the first empty bucket, else the first full slot (indexes into the
   * request's lists); null when a token of every bucket and a slot of every name were taken. */
  refused: { kind: "bucket" | "slot"; index: number } | null;
}

export type RateLimitBackend = "memory" | "postgres" | "redis";

export interface RateLimitState {
  readonly backend: RateLimitBackend;
  /** How long a slot lasts unless renewed, so that a replica that died does not hold it
   * forever; undefined: until released (the slots live and die with the process). */
  readonly leaseMs: number | undefined;
  /** Atomically: refills the buckets, checks them and the slots, and takes a token of each
   * bucket and a slot of each name, or nothing. */
  take(request: TakeRequest): Promise<TakeResult>;
  /** Extends a lease's slots by `leaseMs` from `now`. */
  renew(lease: string, names: readonly string[], now: number): Promise<void>;
  release(lease: string, names: readonly string[]): Promise<void>;
  /** One round trip to where the state is kept (for `/v1/system-check`). */
  ping(): Promise<void>;
  /** Forgets what no check needs any more: buckets idle for a minute (full again, as a name
   * never seen is) and lapsed leases. Returns how many were removed. */
  prune(now: number): Promise<number>;
  close(): Promise<void>;
}

/** Slots last this long unless renewed; holders renew them every third of it. */
export const RATE_LIMIT_LEASE_MS = 30_000;

const MINUTE = 60_000;

/** A bucket of `limit` holding `tokens` at `updated`, refilled to `now` (a clock that went
 * back refills nothing). */
export function refill(limit: number, tokens: number, updated: number, now: number): number {
  return Math.min(limit, tokens + (Math.max(0, now - updated) * limit) / MINUTE);
}

/** The one rule, given each bucket's refilled tokens and each name's held slots. */
function decide(tokens: readonly number[], held: readonly number[], slots: readonly NamedLimit[]) {
  const empty = tokens.findIndex((t) => t < 1);
  if (empty >= 0) return { kind: "bucket" as const, index: empty };
  const full = slots.findIndex((s, i) => (held[i] ?? 0) >= s.limit);
  if (full >= 0) return { kind: "slot" as const, index: full };
  return null;
}

/** One process's limits: each replica would enforce its own share. */
export class MemoryRateLimits implements RateLimitState {
  readonly backend = "memory" as const;
  readonly leaseMs = undefined;
  readonly #buckets = new Map<string, { tokens: number; updated: number }>();
  readonly #held = new Map<string, Set<string>>();

  async take(request: TakeRequest): Promise<TakeResult> {
    const { now } = request;
    const tokens = request.buckets.map(({ name, limit }) => {
      const bucket = this.#buckets.get(name);
      return bucket ? refill(limit, bucket.tokens, bucket.updated, now) : limit;
    });
    const held = request.slots.map(({ name }) => this.#held.get(name)?.size ?? 0);
    const refused = decide(tokens, held, request.slots);
    if (!refused) {
      request.buckets.forEach(({ name }, i) => {
        const updated = Math.max(now, this.#buckets.get(name)?.updated ?? now);
        this.#buckets.set(name, { tokens: tokens[i]! - 1, updated });
      });
      for (const { name } of request.slots) {
        const leases = this.#held.get(name) ?? new Set();
        leases.add(request.lease);
        this.#held.set(name, leases);
      }
    }
    return { tokens, refused };
  }

  async renew(): Promise<void> {}

  async release(lease: string, names: readonly string[]): Promise<void> {
    for (const name of names) {
      const leases = this.#held.get(name);
      leases?.delete(lease);
      if (leases?.size === 0) this.#held.delete(name);
    }
  }

  async ping(): Promise<void> {}

  async prune(now: number): Promise<number> {
    let removed = 0;
    for (const [name, bucket] of this.#buckets)
      if (bucket.updated < now - MINUTE && this.#buckets.delete(name)) removed++;
    return removed;
  }

  async close(): Promise<void> {}
}

/** The `rate_buckets` table: a name's bucket (tokens null: never drawn from, so full). */
const BUCKETS = rowSchema({ name: str, tokens: numOrNull, updated_at: num });
/** A name's live leases, counted. */
const HELD = rowSchema({ name: str, held: num });

/**
 * Limits shared by every replica on one PostgreSQL: one transaction per check. It upserts and
 * locks the row of every name involved (in name order, so two checks never deadlock), counts
 * the names' live leases, and on success writes the drawn buckets, inserts the leases and drops
 * the names' lapsed ones, in one statement.
 */
export class PgRateLimits implements RateLimitState {
  readonly backend = "postgres" as const;
  readonly leaseMs: number;
  readonly #sql: Sql;

  constructor(sql: PostgresSql, options: { leaseMs?: number } = {}) {
    this.#sql = sql;
    this.leaseMs = options.leaseMs ?? RATE_LIMIT_LEASE_MS;
  }

  take(request: TakeRequest): Promise<TakeResult> {
    const { buckets, slots, lease, now } = request;
    const names = [...new Set([...buckets, ...slots].map((l) => l.name))].sort();
    return this.#sql.transaction(async (tx) => {
      // A no-op update on conflict: it locks the row and returns it as it is.
      const rows = await tx.query(
        `INSERT INTO rate_buckets (${BUCKETS.columns()})
         SELECT n, NULL, $2 FROM unnest($1::text[]) WITH ORDINALITY AS u(n, i) ORDER BY i
         ON CONFLICT (name) DO UPDATE SET updated_at = rate_buckets.updated_at
         RETURNING ${BUCKETS.columns()}`,
        [`{${names.map(arrayItem).join(",")}}`, now],
      );
      const state = new Map(rows.map((row) => BUCKETS.read(row)).map((b) => [b.name, b]));
      const tokens = buckets.map(({ name, limit }) => {
        const row = state.get(name);
        return row?.tokens == null ? limit : refill(limit, row.tokens, row.updated_at, now);
      });
      let held: number[] = [];
      if (slots.length > 0 && tokens.every((t) => t >= 1)) {
        const counts = await tx.query(
          `SELECT name, COUNT(*) AS held FROM rate_leases
           WHERE name = ANY($1::text[]) AND expires_at > $2 GROUP BY name`,
          [`{${slots.map((s) => arrayItem(s.name)).join(",")}}`, now],
        );
        const byName = new Map(counts.map((row) => HELD.read(row)).map((c) => [c.name, c.held]));
        held = slots.map((s) => byName.get(s.name) ?? 0);
      }
      const refused = decide(tokens, held, slots);
      if (refused) return { tokens, refused };
      const drawn = buckets.map(({ name }, i) => ({
        name,
        tokens: tokens[i]! - 1,
        updated: Math.max(now, state.get(name)?.updated_at ?? now),
      }));
      await tx.exec(
        `WITH drawn AS (
           UPDATE rate_buckets b SET tokens = d.tokens, updated_at = d.updated
           FROM jsonb_to_recordset($1::jsonb) AS d(name TEXT, tokens DOUBLE PRECISION, updated BIGINT)
           WHERE b.name = d.name
         ), lapsed AS (
           DELETE FROM rate_leases WHERE name = ANY($2::text[]) AND expires_at <= $4
         )
         INSERT INTO rate_leases (name, lease, expires_at)
         SELECT n, $3, $5 FROM unnest($2::text[]) AS n`,
        [
          JSON.stringify(drawn),
          `{${slots.map((s) => arrayItem(s.name)).join(",")}}`,
          lease,
          now,
          now + this.leaseMs,
        ],
      );
      return { tokens, refused: null };
    });
  }

  async renew(lease: string, names: readonly string[], now: number): Promise<void> {
    if (names.length === 0) return;
    // Put back should the lease have lapsed and been dropped meanwhile: the request still runs.
    await this.#sql.exec(
      `INSERT INTO rate_leases (name, lease, expires_at)
       SELECT n, $2, $3 FROM unnest($1::text[]) AS n
       ON CONFLICT (name, lease) DO UPDATE SET expires_at = EXCLUDED.expires_at`,
      [`{${names.map(arrayItem).join(",")}}`, lease, now + this.leaseMs],
    );
  }

  async release(lease: string, names: readonly string[]): Promise<void> {
    if (names.length === 0) return;
    await this.#sql.exec("DELETE FROM rate_leases WHERE name = ANY($1::text[]) AND lease = $2", [
      `{${names.map(arrayItem).join(",")}}`,
      lease,
    ]);
  }

  async ping(): Promise<void> {
    await this.#sql.one("SELECT 1 AS ok");
  }

  /** A check racing a prune locks the row first (its upsert), and the delete then sees the row
   * it wrote, no longer idle: a bucket in use is never forgotten. */
  async prune(now: number): Promise<number> {
    const buckets = await this.#sql.exec("DELETE FROM rate_buckets WHERE updated_at < $1", [
      now - MINUTE,
    ]);
    const leases = await this.#sql.exec("DELETE FROM rate_leases WHERE expires_at <= $1", [now]);
    return buckets + leases;
  }

  /** The store owns the connection pool. */
  async close(): Promise<void> {}
}

/** One element of a PostgreSQL array literal, quoted. */
function arrayItem(value: string): string {
  return `"${value.replace(/[\\"]/g, (c) => `\\${c}`)}"`;
}

/**
 * The check as one Lua script, which Redis runs atomically. KEYS: the buckets (hashes of
 * `tokens`, `updated`), then the slots (sorted sets of leases scored by expiry). ARGV: the
 * number of buckets, of slots, now, the lease, its expiry, the slots' TTL in ms, then each
 * bucket's limit and each slot's. Returns the refusal (0 none, 1 bucket, 2 slot), its 1-based
 * index, then each bucket's refilled tokens as text (a Lua number would come back truncated).
 */
const TAKE_SCRIPT = luaScript(`
local nb, ns = tonumber(ARGV[1]), tonumber(ARGV[2])
local now, lease, expires, ttl = tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local tokens, updated, refused, index = {}, {}, 0, 0
for i = 1, nb do
  local limit = tonumber(ARGV[6 + i])
  local state = redis.call('HMGET', KEYS[i], 'tokens', 'updated')
  local t, u = tonumber(state[1]), tonumber(state[2])
  if t == nil then t, u = limit, now end
  t = math.min(limit, t + math.max(0, now - u) * limit / 60000)
  tokens[i], updated[i] = t, math.max(u, now)
  if refused == 0 and t < 1 then refused, index = 1, i end
end
if refused == 0 then
  for j = 1, ns do
    local key = KEYS[nb + j]
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    if redis.call('ZCARD', key) >= tonumber(ARGV[6 + nb + j]) then
      refused, index = 2, j
      break
    end
  end
end
if refused == 0 then
  for i = 1, nb do
    redis.call('HSET', KEYS[i], 'tokens', string.format('%.17g', tokens[i] - 1), 'updated', updated[i])
    -- A bucket untouched for a minute is full: let it go.
    redis.call('PEXPIRE', KEYS[i], 61000)
  end
  for j = 1, ns do
    redis.call('ZADD', KEYS[nb + j], expires, lease)
    redis.call('PEXPIRE', KEYS[nb + j], ttl)
  end
end
local reply = {refused, index}
for i = 1, nb do reply[2 + i] = string.format('%.17g', tokens[i]) end
return reply
`);

const RENEW_SCRIPT = luaScript(`
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], ARGV[2], ARGV[1])
  redis.call('PEXPIRE', KEYS[i], ARGV[3])
end
return 0
`);

export interface RedisRateLimitsOptions {
  /** Keys are `arbor:rl:{<namespace>}:…`: deployments sharing one Redis keep apart by it (the
   * braces make every key of one deployment one Redis Cluster slot, as a script needs). */
  namespace?: string;
  leaseMs?: number;
}

/** Checks fail at once while the connection is lost (no offline queue), and it is made again
 * after a loss; before the first connection, a failure gives up, so a bad URL stops the start
 * with its cause. The client is loaded here, on first use: importing it takes about half a
 * second, which only deployments with a Redis should pay (the CLI and workers never do). */
async function redisClient(url: string, connected: () => boolean) {
  const { createClient } = await import("@redis/client");
  return createClient({
    url,
    disableOfflineQueue: true,
    socket: {
      connectTimeout: 5000,
      reconnectStrategy: (retries, cause) =>
        connected() ? Math.min(100 * 2 ** retries, 2000) : cause,
    },
  });
}

type Redis = Awaited<ReturnType<typeof redisClient>>;

/** Limits shared by every replica on one Redis: each check is one script, run atomically. */
export class RedisRateLimits implements RateLimitState {
  readonly backend = "redis" as const;
  readonly leaseMs: number;
  readonly #client: Redis;
  readonly #prefix: string;

  private constructor(client: Redis, options: RedisRateLimitsOptions) {
    this.#client = client;
    this.leaseMs = options.leaseMs ?? RATE_LIMIT_LEASE_MS;
    this.#prefix = `arbor:rl:{${options.namespace ?? "default"}}:`;
  }

  /** Connects, failing with the reason when Redis cannot be reached. */
  static async connect(
    url: string,
    options: RedisRateLimitsOptions = {},
  ): Promise<RedisRateLimits> {
    let connected = false;
    const client = await redisClient(url, () => connected);
    let lastError: unknown;
    // A lost connection is reported by the checks that fail, not by crashing the process.
    client.on("error", (err: unknown) => {
      lastError = err;
    });
    try {
      await client.connect();
    } catch (err) {
      client.destroy();
      throw new Error(`cannot reach Redis at ${redacted(url)} (${describe(lastError ?? err)})`);
    }
    connected = true;
    return new RedisRateLimits(client, options);
  }

  async take(request: TakeRequest): Promise<TakeResult> {
    const { buckets, slots, lease, now } = request;
    const reply = (await this.#run(
      TAKE_SCRIPT,
      [...buckets.map((b) => this.#key("b", b.name)), ...slots.map((s) => this.#key("s", s.name))],
      [
        String(buckets.length),
        String(slots.length),
        String(now),
        lease,
        String(now + this.leaseMs),
        String(this.leaseMs),
        ...buckets.map((b) => String(b.limit)),
        ...slots.map((s) => String(s.limit)),
      ],
    )) as (number | string)[];
    const kind = Number(reply[0]);
    return {
      tokens: buckets.map((_, i) => Number(reply[2 + i])),
      refused:
        kind === 0 ? null : { kind: kind === 1 ? "bucket" : "slot", index: Number(reply[1]) - 1 },
    };
  }

  async renew(lease: string, names: readonly string[], now: number): Promise<void> {
    if (names.length === 0) return;
    await this.#run(
      RENEW_SCRIPT,
      names.map((n) => this.#key("s", n)),
      [lease, String(now + this.leaseMs), String(this.leaseMs)],
    );
  }

  async release(lease: string, names: readonly string[]): Promise<void> {
    await Promise.all(names.map((n) => this.#client.zRem(this.#key("s", n), lease)));
  }

  async ping(): Promise<void> {
    await this.#client.ping();
  }

  /** Nothing to do: every key expires by itself (a bucket a minute after its last use). */
  async prune(): Promise<number> {
    return 0;
  }

  /** Closes the connection (once: closing again does nothing). */
  async close(): Promise<void> {
    if (this.#client.isOpen) await this.#client.close();
  }

  #key(kind: "b" | "s", name: string): string {
    return `${this.#prefix}${kind}:${name}`;
  }

  /** EVALSHA; EVAL (which caches the script) when the server does not have it yet. */
  async #run(script: LuaScript, keys: string[], args: string[]): Promise<unknown> {
    try {
      return await this.#client.evalSha(script.sha, { keys, arguments: args });
    } catch (err) {
      if (!String((err as Error).message).startsWith("NOSCRIPT")) throw err;
      return this.#client.eval(script.text, { keys, arguments: args });
    }
  }
}

/** A Lua script and its SHA-1 (what EVALSHA names it by), hashed once. */
interface LuaScript {
  text: string;
  sha: string;
}

function luaScript(text: string): LuaScript {
  return { text, sha: createHash("sha1").update(text).digest("hex") };
}

/** A connection error's code (ECONNREFUSED…), else its message. */
function describe(err: unknown): string {
  if (err instanceof AggregateError && err.errors.length > 0) return describe(err.errors[0]);
  const code = (err as { code?: unknown }).code;
  if (typeof code === "string") return code;
  return err instanceof Error ? err.message || err.name : String(err);
}

/** Where a URL points, without its credentials, for messages. */
function redacted(url: string): string {
  try {
    return new URL(url).host || "the configured URL";
  } catch {
    return "the configured URL";
  }
}

/** The state the server's limiter keeps its counts in: Redis when a URL is given, else the
 * store's PostgreSQL, else this process. */
export async function openRateLimits(options: {
  sql: Sql;
  redisUrl?: string | undefined;
  namespace?: string | undefined;
}): Promise<RateLimitState> {
  if (options.redisUrl) {
    return RedisRateLimits.connect(options.redisUrl, {
      ...(options.namespace ? { namespace: options.namespace } : {}),
    });
  }
  if (options.sql.dialect === "postgres") return new PgRateLimits(options.sql as PostgresSql);
  return new MemoryRateLimits();
}
