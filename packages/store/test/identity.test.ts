import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { expect, it } from "vitest";
import {
  API_KEY_PREFIX,
  ConflictError,
  MIGRATIONS,
  migrate,
  NotFoundError,
  PostgresSql,
  SqliteSql,
} from "../src/index.ts";
import { describeBackends, PG_URL, unique } from "./helpers.ts";

describeBackends("identity", (ctx) => {
  it("when a user is created, then it is a member of its default entity", async () => {
    const entity = unique("team");
    const user = await ctx.store.users.create({ name: unique("alice"), defaultEntity: entity });
    expect(user.default_entity).toBe(entity);
    expect(await ctx.store.users.entitiesOf(user.id)).toEqual([entity]);
    expect(await ctx.store.users.isMember(user.id, entity)).toBe(true);
    expect(await ctx.store.users.isMember(user.id, "elsewhere")).toBe(false);
  });

  it("when a user has memberships, then roleIn names its role in each and nothing elsewhere", async () => {
    const home = unique("home");
    const user = await ctx.store.users.create({ name: unique("erin"), defaultEntity: home });
    const other = unique("other");
    await ctx.store.users.addMembership(user.id, other);
    expect(await ctx.store.users.roleIn(user.id, home)).toBe("admin");
    expect(await ctx.store.users.roleIn(user.id, other)).toBe("member");
    expect(await ctx.store.users.roleIn(user.id, unique("elsewhere"))).toBeUndefined();
  });

  it("when a user name is taken, then create throws ConflictError", async () => {
    const name = unique("bob");
    await ctx.store.users.create({ name, defaultEntity: unique("team") });
    await expect(
      ctx.store.users.create({ name, defaultEntity: unique("team") }),
    ).rejects.toBeInstanceOf(ConflictError);
  });

  it("when memberships change, then entitiesOf and the default follow", async () => {
    const user = await ctx.store.users.create({
      name: unique("carol"),
      defaultEntity: unique("home"),
    });
    const other = unique("other");
    await ctx.store.users.addMembership(user.id, other);
    await ctx.store.users.setDefaultEntity(user.id, other);
    expect((await ctx.store.users.get(user.id))?.default_entity).toBe(other);
    await expect(ctx.store.users.setDefaultEntity(user.id, "not-a-member")).rejects.toBeInstanceOf(
      NotFoundError,
    );
    // The default entity cannot be left.
    expect(await ctx.store.users.removeMembership(user.id, other)).toBe(false);
    expect(await ctx.store.users.removeMembership(user.id, user.default_entity)).toBe(true);
  });

  it("when a key is created, then only its hash is stored and verify finds the user", async () => {
    const user = await ctx.store.users.create({
      name: unique("dave"),
      defaultEntity: unique("team"),
    });
    const { key, token } = await ctx.store.apiKeys.create(user.id, { name: "laptop" });
    expect(token.startsWith(API_KEY_PREFIX)).toBe(true);
    expect(token.startsWith(key.prefix)).toBe(true);
    expect(key.prefix.length).toBeLessThan(token.length);
    const stored = await ctx.store.sql.query<Record<string, unknown>>(
      "SELECT * FROM api_keys WHERE id = $1",
      [key.id],
    );
    expect(JSON.stringify(stored)).not.toContain(token);

    const identity = await ctx.store.apiKeys.verify(token);
    expect(identity).toMatchObject({
      key_id: key.id,
      user_id: user.id,
      default_entity: user.default_entity,
    });
    expect(identity?.entities).toEqual([user.default_entity]);
    expect((await ctx.store.apiKeys.list(user.id))[0]?.last_used_at).not.toBeNull();
  });

  it("when a key is created as an operator's, then it is listed and verified as one, and other keys of the same user are not", async () => {
    const user = await ctx.store.users.create({
      name: unique("olga"),
      defaultEntity: unique("ops"),
    });
    const operator = await ctx.store.apiKeys.create(user.id, { operator: true });
    const plain = await ctx.store.apiKeys.create(user.id);
    expect(operator.key.operator).toBe(true);
    expect(plain.key.operator).toBe(false);
    expect((await ctx.store.apiKeys.verify(operator.token))?.operator).toBe(true);
    expect((await ctx.store.apiKeys.verify(plain.token))?.operator).toBe(false);
    expect((await ctx.store.apiKeys.list(user.id)).map((k) => k.operator)).toEqual([true, false]);
  });

  it("when keys were made before operator keys existed, then migrating to version 8 makes the first-start admin's keys operators' and no other", async () => {
    const dir = join(ctx.dataDir, "v7-keys");
    mkdirSync(dir, { recursive: true });
    const schema = `${ctx.schema}_v7k`;
    const fresh =
      ctx.backend === "sqlite"
        ? new SqliteSql({ path: join(dir, "arbor.db") })
        : new PostgresSql({ connectionString: PG_URL, schema });
    if (ctx.backend === "postgres") await fresh.exec(`CREATE SCHEMA ${schema}`);
    try {
      await migrate(fresh, MIGRATIONS.slice(0, 7));
      for (const entity of ["default", "acme"])
        await fresh.exec("INSERT INTO entities (name, created_at) VALUES ($1, 0)", [entity]);
      // The first start's admin, a second admin of `default`, and another entity's admin.
      for (const [id, name, entity] of [
        ["u1", "admin", "default"],
        ["u2", "bob", "default"],
        ["u3", "admin2", "acme"],
      ] as const) {
        await fresh.exec(
          "INSERT INTO users (id, name, default_entity, created_at) VALUES ($1, $2, $3, 0)",
          [id, name, entity],
        );
        await fresh.exec(
          `INSERT INTO api_keys (id, user_id, prefix, hash, created_at)
           VALUES ($1, $2, 'sk-arb-x', $3, 0)`,
          [`k-${id}`, id, `hash-${id}`],
        );
      }
      expect(await migrate(fresh, MIGRATIONS.slice(0, 8))).toEqual([8]);
      const keys = await fresh.query<{ id: string; operator: number }>(
        "SELECT id, operator FROM api_keys ORDER BY id",
      );
      expect(keys.map((k) => [k.id, Number(k.operator)])).toEqual([
        ["k-u1", 1],
        ["k-u2", 0],
        ["k-u3", 0],
      ]);
    } finally {
      await fresh.close();
      if (ctx.backend === "postgres")
        await ctx.store.sql.exec(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
    }
  });

  it.each([
    ["unknown", `${API_KEY_PREFIX}nope`],
    ["malformed", "Bearer something"],
    ["empty", ""],
  ])("when a key is %s, then verify returns undefined", async (_, token) => {
    expect(await ctx.store.apiKeys.verify(token)).toBeUndefined();
  });

  it("when a key is revoked, then the next verify fails", async () => {
    const user = await ctx.store.users.create({
      name: unique("erin"),
      defaultEntity: unique("team"),
    });
    const { key, token } = await ctx.store.apiKeys.create(user.id);
    expect(await ctx.store.apiKeys.verify(token)).toBeDefined();
    const revoked = await ctx.store.apiKeys.revoke(user.id, key.id);
    expect(revoked.revoked_at).not.toBeNull();
    expect(await ctx.store.apiKeys.verify(token)).toBeUndefined();
    await expect(ctx.store.apiKeys.revoke("someone-else", key.id)).rejects.toBeInstanceOf(
      NotFoundError,
    );
  });
});
