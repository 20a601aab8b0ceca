import { openStore, type Store } from "@arbor/store";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { createKey, listKeys, listPrices, revokeKey, setPrice } from "./admin.ts";

let store: Store;
let lines: string[];
const out = { line: (text: string) => lines.push(text) };
beforeEach(async () => {
  store = await openStore({ dataDir: ":memory:" });
  lines = [];
});
afterEach(() => store.close());

describe("keys", () => {
  it("when a key is created for a new user, then it verifies for that entity and is listed by prefix only", async () => {
    const token = await createKey(store, { user: "alice", entity: "acme" }, out);
    expect(lines.at(-1)).toBe(token);
    const identity = await store.apiKeys.verify(token);
    expect(identity).toMatchObject({
      user_name: "alice",
      default_entity: "acme",
      entities: ["acme"],
    });
    lines = [];
    await listKeys(store, {}, out);
    expect(lines.join("\n")).toContain(token.slice(0, 13));
    expect(lines.join("\n")).not.toContain(token);
  });

  it("when an existing user gets a key for another entity, then it becomes a member of both", async () => {
    await createKey(store, { user: "bob", entity: "one" }, out);
    const token = await createKey(store, { user: "bob", entity: "two" }, out);
    expect((await store.apiKeys.verify(token))?.entities).toEqual(["one", "two"]);
  });

  it("when a key is revoked by its prefix, then it no longer verifies", async () => {
    const token = await createKey(store, { user: "carol", entity: "acme" }, out);
    await revokeKey(store, { key: `${token.slice(0, 13)}…` }, out);
    expect(await store.apiKeys.verify(token)).toBeUndefined();
    await expect(revokeKey(store, { key: token.slice(0, 13) }, out)).rejects.toThrow(
      /No active key/,
    );
  });
});

describe("prices", () => {
  it("when a default and a project price are set, then the project sees both and the defaults list shows one", async () => {
    await setPrice(
      store,
      { model: "m", prompt: 0.001, completion: 0.002, effective: "2026-01-01" },
      out,
    );
    await setPrice(
      store,
      { model: "m", prompt: 0.5, completion: 0.5, project: "acme/p", effective: "2026-01-01" },
      out,
    );
    lines = [];
    await listPrices(store, {}, out);
    expect(lines).toHaveLength(2);
    lines = [];
    await listPrices(store, { project: "acme/p" }, out);
    expect(lines).toHaveLength(3);
    expect(lines.join("\n")).toMatch(/\(default\).*0\.001/);
    expect(lines.join("\n")).toMatch(/acme\/p.*0\.5/);
  });
});
