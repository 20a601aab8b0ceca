import { expect, it } from "vitest";
import { API_KEY_PREFIX, ConflictError, NotFoundError } from "../src/index.ts";
import { describeBackends, unique } from "./helpers.ts";

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
