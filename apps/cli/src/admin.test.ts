import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { FsBlobStore, openStore, type Store } from "@arbor/store";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { createKey, importBlobs, listKeys, listPrices, revokeKey, setPrice } from "./admin.ts";

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

  it("when a key is created with --operator, then it verifies as an operator's and is listed as one; a plain key is not", async () => {
    const operator = await createKey(
      store,
      { user: "prometheus", entity: "ops", operator: true },
      out,
    );
    expect(lines.at(-3)).toMatch(/^Created operator key sk-arb-/);
    const plain = await createKey(store, { user: "alice", entity: "default" }, out);
    expect((await store.apiKeys.verify(operator))?.operator).toBe(true);
    expect((await store.apiKeys.verify(plain))?.operator).toBe(false);
    lines = [];
    await listKeys(store, {}, out);
    const rows = lines.map((line) => line.split("\t"));
    const column = rows[0]!.indexOf("operator");
    expect(rows.find((r) => r[0] === "prometheus")?.[column]).toBe("yes");
    expect(rows.find((r) => r[0] === "alice")?.[column]).toBe("");
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

describe("blobs import", () => {
  it("when a data directory's files are imported, then the store's blobs have them, and a second run copies nothing", async () => {
    const dir = mkdtempSync(join(tmpdir(), "arbor-import-"));
    try {
      const old = new FsBlobStore(join(dir, "old"));
      await old.put("datasets/a.jsonl", '{"messages": []}\n');
      await old.put("checkpoints/m/1-x/adapter_model.safetensors", new Uint8Array([1, 2, 3]));
      const target = await openStore({ dataDir: ":memory:", blobDir: join(dir, "new") });
      try {
        await target.blobs.put("datasets/a.jsonl", "already here");
        const result = await importBlobs(target, { from: join(dir, "old") }, out);
        expect(result).toEqual({ copied: 1, skipped: 1 });
        expect(lines.at(-1)).toBe(
          `Imported 1 files from ${join(dir, "old")} (1 were already there).`,
        );
        expect([
          ...(await target.blobs.get("checkpoints/m/1-x/adapter_model.safetensors"))!,
        ]).toEqual([1, 2, 3]);
        expect((await target.blobs.get("datasets/a.jsonl"))!.toString()).toBe("already here");
        expect(await importBlobs(target, { from: join(dir, "old") }, out)).toEqual({
          copied: 0,
          skipped: 2,
        });
        await expect(importBlobs(target, { from: join(dir, "new") }, out)).rejects.toThrow(
          "this store's own blob directory",
        );
      } finally {
        await target.close();
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
