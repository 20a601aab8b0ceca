import pg from "pg";

/** The PostgreSQL the Postgres halves of the contract tests use (ARBOR_TEST_PG overrides). */
export const PG_URL = process.env.ARBOR_TEST_PG ?? "postgres://postgres@127.0.0.1:5432/test";

/** Drops a test's schema and everything in it (`url`: another database than PG_URL). */
export async function dropSchema(schema: string, url = PG_URL): Promise<void> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    await client.query(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
  } finally {
    await client.end();
  }
}

/**
 * Null when PostgreSQL answers; else why not, printed once. Under `CI=true` an unreachable
 * PostgreSQL is an error, not a skip: CI machines have one.
 */
export const pgSkipReason: string | null = await (async () => {
  if (process.env.ARBOR_TEST_PG === "off") {
    console.log("[contract] ARBOR_TEST_PG=off: the Postgres half is SKIPPED");
    return "ARBOR_TEST_PG=off";
  }
  const client = new pg.Client({ connectionString: PG_URL, connectionTimeoutMillis: 10_000 });
  try {
    await client.connect();
    await client.query("SELECT 1");
    return null;
  } catch (err) {
    if (process.env.ARBOR_TEST_PG === "off") return "ARBOR_TEST_PG=off";
    const reason = `PostgreSQL at ${PG_URL} is unreachable (${(err as Error).message})`;
    if (process.env.CI === "true") throw new Error(`${reason}; CI needs it.`);
    console.log(`[contract] ${reason}: the Postgres half is SKIPPED`);
    return reason;
  } finally {
    await client.end().catch(() => {});
  }
})();

/** The stores a case runs on (the PostgreSQL half is skipped where none answers). */
export const STORES = [
  { name: "SQLite", postgres: undefined, skip: null },
  { name: "PostgreSQL", postgres: { url: PG_URL }, skip: pgSkipReason },
] as const;
