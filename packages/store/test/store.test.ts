import { expect, it } from "vitest";
import { MemoryBlobStore, MIGRATIONS, migrate, openStore } from "../src/index.ts";
import { describeBackends } from "./helpers.ts";

describeBackends("openStore", (ctx) => {
  it("when opened, then every migration is applied once and recorded", async () => {
    expect(ctx.store.migrated).toEqual(MIGRATIONS.map((m) => m.version));
    const again = await ctx.openAnother();
    expect(again.migrated).toEqual([]);
    expect(await migrate(ctx.store.sql)).toEqual([]);
    const rows = await ctx.store.sql.query<{ version: number }>(
      "SELECT version FROM schema_migrations ORDER BY version",
    );
    expect(rows.map((r) => Number(r.version))).toEqual(MIGRATIONS.map((m) => m.version));
  });

  it("when pinged, then it reports success and a duration", async () => {
    const ping = await ctx.store.ping();
    expect(ping.success).toBe(true);
    expect(ping.error).toBeNull();
    expect(ping.duration).toBeGreaterThanOrEqual(0);
  });

  it("when placeholders repeat or come out of order, then each binds its own value", async () => {
    const row = await ctx.store.sql.one<{ a: string; b: string; c: string }>(
      "SELECT CAST($2 AS TEXT) AS b, CAST($1 AS TEXT) AS a, CAST($2 AS TEXT) AS c",
      ["one", "two"],
    );
    expect(row).toEqual({ b: "two", a: "one", c: "two" });
  });

  it("when the database is gone, then ping reports the failure instead of throwing", async () => {
    const other = await ctx.openAnother();
    await other.close();
    const ping = await other.ping();
    expect(ping.success).toBe(false);
    expect(ping.error).toEqual(expect.any(String));
  });

  it("when a transaction throws, then none of its writes remain", async () => {
    await expect(
      ctx.store.sql.transaction(async (tx) => {
        await tx.exec("INSERT INTO entities (name, created_at) VALUES ($1, $2)", [
          "rolled-back",
          1,
        ]);
        throw new Error("boom");
      }),
    ).rejects.toThrow("boom");
    expect(await ctx.store.entities.get("rolled-back")).toBeUndefined();
  });

  it("when transactions and plain statements interleave, then each transaction sees only its own writes", async () => {
    const results = await Promise.all(
      Array.from({ length: 10 }, (_, i) =>
        ctx.store.sql.transaction(async (tx) => {
          await tx.exec("INSERT INTO entities (name, created_at) VALUES ($1, $2)", [`tx-${i}`, i]);
          await new Promise((r) => setImmediate(r));
          const row = await tx.one<{ n: number }>(
            "SELECT COUNT(*) AS n FROM entities WHERE name = $1",
            [`tx-${i}`],
          );
          return Number(row?.n);
        }),
      ),
    );
    expect(results).toEqual(Array(10).fill(1));
    const committed = await ctx.store.sql.one<{ n: number }>(
      "SELECT COUNT(*) AS n FROM entities WHERE name LIKE 'tx-%'",
    );
    expect(Number(committed?.n)).toBe(10);
  });

  it("when a plain statement runs during a transaction, then it does not see the uncommitted row", async () => {
    const count = async () =>
      Number(
        (
          await ctx.store.sql.one<{ n: number }>(
            "SELECT COUNT(*) AS n FROM entities WHERE name = 'uncommitted'",
          )
        )?.n,
      );
    let outside: Promise<number> | undefined;
    await ctx.store.sql.transaction(async (tx) => {
      await tx.exec("INSERT INTO entities (name, created_at) VALUES ('uncommitted', 1)");
      // PostgreSQL runs it on another connection now; SQLite (one connection) after the commit.
      outside = count();
      if (ctx.backend === "postgres") expect(await outside).toBe(0);
    });
    if (ctx.backend === "sqlite") expect(await outside).toBe(1);
    expect(await count()).toBe(1);
  });

  it("when two openers migrate a fresh database at once, then both succeed", async () => {
    const fresh =
      ctx.backend === "sqlite"
        ? { dataDir: `${ctx.dataDir}/fresh` }
        : { schema: `${ctx.schema}_b` };
    const [a, b] = await Promise.all([
      openStore(ctx.options(fresh)),
      openStore(ctx.options(fresh)),
    ]);
    expect([...a.migrated, ...b.migrated].sort((x, y) => x - y)).toEqual(
      MIGRATIONS.map((m) => m.version),
    );
    await a.close();
    await b.close();
    if (ctx.backend === "postgres") await ctx.store.sql.exec(`DROP SCHEMA ${ctx.schema}_b CASCADE`);
  });
});

it("opens an in-memory SQLite store by default, with its blobs in memory too", async () => {
  const store = await openStore();
  expect(store.dialect).toBe("sqlite");
  expect(store.blobs).toBeInstanceOf(MemoryBlobStore);
  await store.blobs.put("datasets/d.jsonl", "{}\n");
  expect((await store.blobs.get("datasets/d.jsonl"))?.toString()).toBe("{}\n");
  expect((await store.ping()).success).toBe(true);
  await store.close();
});

it("when blobs in files are asked for on PostgreSQL with no directory for them, then it does not open", async () => {
  await expect(
    openStore({ databaseUrl: "postgres://127.0.0.1:1/none", blobs: "fs", dataDir: ":memory:" }),
  ).rejects.toThrow("Blobs in files (fs) on PostgreSQL need a dataDir or a blobDir.");
});
