import { RedisRateLimits } from "@arbor/store";

/** The Redis the Redis halves of the contract tests use (ARBOR_TEST_REDIS overrides). */
export const REDIS_URL = process.env.ARBOR_TEST_REDIS ?? "redis://127.0.0.1:6379";

/**
 * Null when Redis answers; else why not, printed once. Under `CI=true` an unreachable Redis is
 * an error, not a skip, as for PostgreSQL.
 */
export const redisSkipReason: string | null = await (async () => {
  if (process.env.ARBOR_TEST_REDIS === "off") {
    console.log("[contract] ARBOR_TEST_REDIS=off: the Redis half is SKIPPED");
    return "ARBOR_TEST_REDIS=off";
  }
  try {
    const state = await RedisRateLimits.connect(REDIS_URL);
    await state.ping();
    await state.close();
    return null;
  } catch (err) {
    const reason = `Redis at ${REDIS_URL} is unreachable (${(err as Error).message})`;
    if (process.env.CI === "true") throw new Error(`${reason}; CI needs it.`);
    console.log(`[contract] ${reason}: the Redis half is SKIPPED`);
    return reason;
  }
})();
