import { mkdtempSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Readable } from "node:stream";
import { afterAll, describe, expect, it, vi } from "vitest";
import { assertBlobKey, FsBlobStore } from "../src/index.ts";

describe("FsBlobStore", () => {
  const root = mkdtempSync(join(tmpdir(), "arbor-blobs-"));
  const blobs = new FsBlobStore(root);
  afterAll(() => rmSync(root, { recursive: true, force: true }));

  it("when bytes, strings and streams are put, then get returns them and no temp file remains", async () => {
    expect(await blobs.put("models/a/0/adapter.bin", new Uint8Array([1, 2, 3]))).toEqual({
      bytes: 3,
    });
    expect(await blobs.put("datasets/d1.jsonl", '{"messages":[]}\n')).toEqual({ bytes: 16 });
    const stream = Readable.from([Buffer.from("ab"), Buffer.from("cd")]);
    expect(await blobs.put("models/a/1/adapter.bin", stream)).toEqual({ bytes: 4 });
    expect([...((await blobs.get("models/a/0/adapter.bin")) ?? [])]).toEqual([1, 2, 3]);
    expect((await blobs.get("models/a/1/adapter.bin"))?.toString()).toBe("abcd");
    expect(await blobs.exists("datasets/d1.jsonl")).toBe(true);
    expect(await blobs.get("nope")).toBeUndefined();
    expect(await blobs.exists("nope")).toBe(false);
    expect(await blobs.info("models/a/1/adapter.bin")).toEqual({
      bytes: 4,
      modifiedAt: expect.any(Number),
    });
    expect(await blobs.info("nope")).toBeUndefined();
    expect(readdirSync(join(root, "models", "a", "0"))).toEqual(["adapter.bin"]);
    const chunks: Buffer[] = [];
    for await (const c of (await blobs.stream("models/a/1/adapter.bin"))!) chunks.push(c as Buffer);
    expect(Buffer.concat(chunks).toString()).toBe("abcd");
  });

  it("when a key is overwritten, then readers see the whole new content", async () => {
    await blobs.put("over/x", "old");
    await blobs.put("over/x", "new content");
    expect((await blobs.get("over/x"))?.toString()).toBe("new content");
  });

  it("when a stream fails mid-put, then the old blob stays and the temp file is removed", async () => {
    await blobs.put("fail/x", "kept");
    async function* broken() {
      yield Buffer.from("partial");
      throw new Error("disk on fire");
    }
    await expect(blobs.put("fail/x", broken())).rejects.toThrow("disk on fire");
    expect((await blobs.get("fail/x"))?.toString()).toBe("kept");
    expect(readdirSync(join(root, "fail"))).toEqual(["x"]);
  });

  it("when a prefix is deleted, then only its keys go", async () => {
    await blobs.put("models/b/0/a", "1");
    await blobs.put("models/b/1/a", "2");
    await blobs.put("models/bb/0/a", "3");
    expect(await blobs.list("models/b/")).toEqual(["models/b/0/a", "models/b/1/a"]);
    expect(await blobs.deletePrefix("models/b/")).toBe(2);
    expect(await blobs.exists("models/bb/0/a")).toBe(true);
    expect(readdirSync(join(root, "models")).sort()).toEqual(["a", "bb"]);
    expect(await blobs.delete("models/bb/0/a")).toBe(true);
    expect(await blobs.delete("models/bb/0/a")).toBe(false);
  });

  it("when partial files are swept, then a dead writer's go and a live writer's stay", async () => {
    let finish!: () => void;
    const held = new Promise<void>((resolve) => {
      finish = resolve;
    });
    async function* slow() {
      yield Buffer.from("partial");
      await held;
    }
    const writing = blobs.put("sweep/x", slow());
    await vi.waitFor(() =>
      expect(readdirSync(join(root, "sweep")).some((n) => n.includes(".tmp-"))).toBe(true),
    );
    const live = readdirSync(join(root, "sweep"))[0]!;
    // The same host's writer with a process that no longer runs (above Linux's default pid_max).
    const host = /\.tmp-([0-9a-f]{8})-\d+-/.exec(live)![1];
    const dead = `y.tmp-${host}-4194305-aa`;
    writeFileSync(join(root, "sweep", dead), "partial");
    expect(await blobs.sweepPartial()).toEqual([`sweep/${dead}`]);
    expect(readdirSync(join(root, "sweep"))).toEqual([live]);
    finish();
    await writing;
    expect((await blobs.get("sweep/x"))?.toString()).toBe("partial");
  });

  it.each(["../etc/passwd", "/abs", "a//b", "a/../b", "", "a/./b", "sp ace"])(
    "when the key is %j, then it is refused",
    (key) => {
      expect(() => assertBlobKey(key)).toThrow(RangeError);
    },
  );
});
