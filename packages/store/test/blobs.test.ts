import { mkdtempSync, readdirSync, rmSync, utimesSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Readable } from "node:stream";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { PATIENT } from "../../../vitest.shared.ts";
import {
  assertBlobKey,
  BlobChangedError,
  type BlobStore,
  FsBlobStore,
  MemoryBlobStore,
  PgBlobStore,
  type PostgresSql,
  WRITER_TAG,
} from "../src/index.ts";
import { pgSkipReason, StoreContext } from "./helpers.ts";

/** Chunk rows of 5 bytes: every PostgreSQL blob below is cut into several. */
const CHUNK = 5;

interface Backend {
  name: string;
  skip: boolean;
  open(): Promise<{ blobs: BlobStore; close(): Promise<void>; another(): BlobStore }>;
}

const backends: Backend[] = [
  {
    name: "FsBlobStore",
    skip: false,
    async open() {
      const root = mkdtempSync(join(tmpdir(), "arbor-blobs-"));
      return {
        blobs: new FsBlobStore(root),
        another: () => new FsBlobStore(root),
        close: async () => rmSync(root, { recursive: true, force: true }),
      };
    },
  },
  {
    name: "MemoryBlobStore",
    skip: false,
    async open() {
      const blobs = new MemoryBlobStore();
      // One process's memory: another handle is the same store.
      return { blobs, another: () => blobs, close: async () => {} };
    },
  },
  {
    name: "PgBlobStore",
    skip: pgSkipReason !== null,
    async open() {
      const ctx = new StoreContext("postgres");
      await ctx.setup();
      const other = await ctx.openAnother();
      const sql = ctx.store.sql as PostgresSql;
      return {
        blobs: new PgBlobStore(sql, ctx.now, { chunkBytes: CHUNK }),
        // Another pool on the same schema: a second replica.
        another: () => new PgBlobStore(other.sql as PostgresSql, ctx.now, { chunkBytes: CHUNK }),
        close: () => ctx.teardown(),
      };
    },
  },
];

async function text(stream: Readable | undefined): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const c of stream!) chunks.push(c as Buffer);
  return Buffer.concat(chunks).toString();
}

for (const backend of backends) {
  describe.skipIf(backend.skip)(`BlobStore contract [${backend.name}]`, () => {
    let blobs: BlobStore;
    let another: () => BlobStore;
    let close: () => Promise<void>;
    beforeAll(async () => {
      ({ blobs, another, close } = await backend.open());
    });
    afterAll(() => close());

    it("when bytes, strings and streams are put, then get, stream and info return them", async () => {
      expect(await blobs.put("models/a/0/adapter.bin", new Uint8Array([1, 2, 3]))).toEqual({
        bytes: 3,
      });
      expect(await blobs.put("datasets/d1.jsonl", '{"messages":[]}\n')).toEqual({ bytes: 16 });
      const stream = Readable.from([Buffer.from("ab"), Buffer.from("cd")]);
      expect(await blobs.put("models/a/1/adapter.bin", stream)).toEqual({ bytes: 4 });
      expect([...((await blobs.get("models/a/0/adapter.bin")) ?? [])]).toEqual([1, 2, 3]);
      expect((await blobs.get("models/a/1/adapter.bin"))?.toString()).toBe("abcd");
      expect((await blobs.get("datasets/d1.jsonl"))?.toString()).toBe('{"messages":[]}\n');
      expect(await blobs.exists("datasets/d1.jsonl")).toBe(true);
      expect(await blobs.get("nope")).toBeUndefined();
      expect(await blobs.stream("nope")).toBeUndefined();
      expect(await blobs.exists("nope")).toBe(false);
      expect(await blobs.info("models/a/1/adapter.bin")).toEqual({
        bytes: 4,
        modifiedAt: expect.any(Number),
      });
      expect(await blobs.info("nope")).toBeUndefined();
      expect(await text(await blobs.stream("models/a/1/adapter.bin"))).toBe("abcd");
    });

    it("when a body spans many chunks, then every byte comes back, multi-byte characters too", async () => {
      // 3- and 4-byte characters (a surrogate pair) across every chunk and slice boundary.
      const body = "añ€😀".repeat(997);
      expect(await blobs.put("big/text", body)).toEqual({ bytes: Buffer.byteLength(body) });
      expect((await blobs.get("big/text"))?.toString()).toBe(body);
      expect(await text(await blobs.stream("big/text"))).toBe(body);
      const bytes = Buffer.from(Array.from({ length: 4099 }, (_, i) => (i * 7) % 256));
      const pieces = [1, 2, 3, 100, 1000, 2993].map((n, i, all) => {
        const start = all.slice(0, i).reduce((a, b) => a + b, 0);
        return bytes.subarray(start, start + n);
      });
      expect(await blobs.put("big/stream", Readable.from(pieces))).toEqual({ bytes: 4099 });
      expect((await blobs.get("big/stream"))?.equals(bytes)).toBe(true);
      expect(await blobs.put("big/bytes", bytes)).toEqual({ bytes: 4099 });
      expect((await blobs.get("big/bytes"))?.equals(bytes)).toBe(true);
      expect(await blobs.put("big/empty", "")).toEqual({ bytes: 0 });
      expect((await blobs.get("big/empty"))?.length).toBe(0);
      expect(await text(await blobs.stream("big/empty"))).toBe("");
    });

    it("when a key is overwritten, then readers see the whole new content", async () => {
      await blobs.put("over/x", "old");
      await blobs.put("over/x", "new content");
      expect((await blobs.get("over/x"))?.toString()).toBe("new content");
      await blobs.put("over/x", "s");
      expect((await blobs.get("over/x"))?.toString()).toBe("s");
      expect(await blobs.info("over/x")).toMatchObject({ bytes: 1 });
    });

    it("when a put is under way, then readers see the old bytes until it is done", async () => {
      await blobs.put("atomic/x", "old bytes");
      let finish!: () => void;
      const held = new Promise<void>((resolve) => {
        finish = resolve;
      });
      let started!: () => void;
      const begun = new Promise<void>((resolve) => {
        started = resolve;
      });
      async function* slow() {
        yield Buffer.from("new bytes, ");
        yield Buffer.from("part one");
        started();
        await held;
        yield Buffer.from(" and part two");
      }
      const writing = blobs.put("atomic/x", slow());
      await begun;
      expect((await blobs.get("atomic/x"))?.toString()).toBe("old bytes");
      expect(await text(await blobs.stream("atomic/x"))).toBe("old bytes");
      finish();
      await writing;
      expect((await blobs.get("atomic/x"))?.toString()).toBe("new bytes, part one and part two");
    });

    it("when a stream fails mid-put, then the old blob stays", async () => {
      await blobs.put("fail/x", "kept");
      async function* broken() {
        yield Buffer.from("partial, longer than a chunk");
        throw new Error("disk on fire");
      }
      await expect(blobs.put("fail/x", broken())).rejects.toThrow("disk on fire");
      expect((await blobs.get("fail/x"))?.toString()).toBe("kept");
      expect(await blobs.list("fail/")).toEqual(["fail/x"]);
    });

    it("when a prefix is deleted, then only its keys go", async () => {
      await blobs.put("models/b/0/a", "1");
      await blobs.put("models/b/1/a", "2");
      await blobs.put("models/bb/0/a", "3");
      expect(await blobs.list("models/b/")).toEqual(["models/b/0/a", "models/b/1/a"]);
      expect(await blobs.list("models/b")).toEqual([
        "models/b/0/a",
        "models/b/1/a",
        "models/bb/0/a",
      ]);
      expect(await blobs.deletePrefix("models/b/")).toBe(2);
      expect(await blobs.exists("models/bb/0/a")).toBe(true);
      expect(await blobs.exists("models/b/0/a")).toBe(false);
      expect(await blobs.delete("models/bb/0/a")).toBe(true);
      expect(await blobs.delete("models/bb/0/a")).toBe(false);
      await expect(blobs.deletePrefix("")).rejects.toThrow(RangeError);
    });

    it("when another handle (another replica) reads, then it sees the same blobs", async () => {
      await blobs.put("shared/a.jsonl", "from A");
      const other = another();
      expect((await other.get("shared/a.jsonl"))?.toString()).toBe("from A");
      await other.put("shared/b.jsonl", "from B");
      expect(await blobs.list("shared/")).toEqual(["shared/a.jsonl", "shared/b.jsonl"]);
      expect(await other.delete("shared/a.jsonl")).toBe(true);
      expect(await blobs.exists("shared/a.jsonl")).toBe(false);
    });

    it.each(["../etc/passwd", "/abs", "a//b", "a/../b", "", "a/./b", "sp ace"])(
      "when the key is %j, then it is refused",
      async (key) => {
        expect(() => assertBlobKey(key)).toThrow(RangeError);
        await expect(blobs.put(key, "x")).rejects.toThrow(RangeError);
        await expect(blobs.get(key)).rejects.toThrow(RangeError);
      },
    );
  });
}

describe("MemoryBlobStore", () => {
  it("when a caller changes the bytes it put, got or streamed, then the blob stays as put", async () => {
    const blobs = new MemoryBlobStore();
    const body = Buffer.from("abc");
    await blobs.put("k/x", body);
    body.fill(0);
    (await blobs.get("k/x"))!.fill(0);
    for await (const chunk of (await blobs.stream("k/x"))!) (chunk as Buffer).fill(0);
    expect((await blobs.get("k/x"))?.toString()).toBe("abc");
  });

  it("when a blob is written, then its time is the store's clock", async () => {
    const blobs = new MemoryBlobStore(() => 1234);
    await blobs.put("k/t", "x");
    expect(await blobs.info("k/t")).toEqual({ bytes: 1, modifiedAt: 1234 });
    expect(await blobs.sweepPartial()).toEqual([]);
  });
});

describe("FsBlobStore", () => {
  const root = mkdtempSync(join(tmpdir(), "arbor-blobs-"));
  const blobs = new FsBlobStore(root);
  afterAll(() => rmSync(root, { recursive: true, force: true }));

  it("when blobs are put, then no temp file remains beside them", async () => {
    await blobs.put("models/a/0/adapter.bin", new Uint8Array([1, 2, 3]));
    await blobs.put("models/a/0/config.json", "{}");
    expect(readdirSync(join(root, "models", "a", "0")).sort()).toEqual([
      "adapter.bin",
      "config.json",
    ]);
  });

  it("when a stream fails mid-put, then its temp file is removed", async () => {
    await blobs.put("fail/x", "kept");
    async function* broken() {
      yield Buffer.from("partial");
      throw new Error("disk on fire");
    }
    await expect(blobs.put("fail/x", broken())).rejects.toThrow("disk on fire");
    expect(readdirSync(join(root, "fail"))).toEqual(["x"]);
  });

  it("when a prefix is deleted, then its emptied directories go too", async () => {
    await blobs.put("models/b/0/a", "1");
    await blobs.put("models/bb/0/a", "3");
    await blobs.deletePrefix("models/b/");
    expect(readdirSync(join(root, "models")).sort()).toEqual(["a", "bb"]);
  });

  it("when a prefix's only folder is deleted, then the folders it emptied above it go too", async () => {
    await blobs.put("lone/m/0/a", "1");
    await blobs.put("lone/m/1/a", "2");
    await blobs.deletePrefix("lone/m/0/");
    expect(readdirSync(join(root, "lone", "m"))).toEqual(["1"]);
    await blobs.deletePrefix("lone/m/1/");
    expect(readdirSync(root)).not.toContain("lone");
  });

  it("when a folder is deleted while puts write into it, then the delete never fails and each put lands whole or fails as missing, leaving no file", async () => {
    const body = Buffer.alloc(256 * 1024, 7);
    for (let round = 0; round < 20; round++) {
      // Settled from the start: a put that fails while the delete runs is not left unhandled.
      const puts = Promise.allSettled(
        Array.from({ length: 6 }, (_, i) => blobs.put(`race/m/${i % 2}-${round}/file-${i}`, body)),
      );
      await expect(blobs.deletePrefix("race/m/")).resolves.toBeGreaterThanOrEqual(0);
      for (const result of await puts) {
        if (result.status === "rejected")
          expect((result.reason as NodeJS.ErrnoException).code).toBe("ENOENT");
      }
      await blobs.deletePrefix("race/m/");
      expect(await blobs.list("race/")).toEqual([]);
    }
    expect(readdirSync(root)).not.toContain("race");
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
    await vi.waitFor(
      () => expect(readdirSync(join(root, "sweep")).some((n) => n.includes(".tmp-"))).toBe(true),
      PATIENT,
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

  it("when a partial file is another host's, then it goes once a day old; one of this pid, once written before this process started", async () => {
    const ago = (ms: number) => new Date(Date.now() - ms);
    const partial = (name: string, at?: Date) => {
      writeFileSync(join(root, "aged", name), "partial");
      if (at) utimesSync(join(root, "aged", name), at, at);
    };
    await blobs.put("aged/kept", "whole");
    // An earlier process that had this pid (a container's server is often pid 1 on each start).
    partial(`a.tmp-${WRITER_TAG}-aa`, ago(process.uptime() * 1000 + 60_000));
    partial("b.tmp-0badc0de-12-bb", ago(25 * 60 * 60_000));
    partial(`c.tmp-${WRITER_TAG}-cc`);
    partial("d.tmp-0badc0de-12-dd", ago(60 * 60_000));
    expect((await blobs.sweepPartial()).sort()).toEqual(
      [`aged/a.tmp-${WRITER_TAG}-aa`, "aged/b.tmp-0badc0de-12-bb"].sort(),
    );
    expect(readdirSync(join(root, "aged")).sort()).toEqual(
      [`c.tmp-${WRITER_TAG}-cc`, "d.tmp-0badc0de-12-dd", "kept"].sort(),
    );
  });
});

describe.skipIf(pgSkipReason !== null)("PgBlobStore", () => {
  const ctx = new StoreContext("postgres");
  let blobs: PgBlobStore;
  let sql: PostgresSql;
  beforeAll(async () => {
    await ctx.setup();
    sql = ctx.store.sql as PostgresSql;
    blobs = new PgBlobStore(sql, ctx.now, { chunkBytes: CHUNK });
  });
  afterAll(() => ctx.teardown());

  const chunkRows = (key: string) =>
    sql.query<{ version: string; seq: number; size: number }>(
      "SELECT version, seq, length(data) AS size FROM blob_chunks WHERE key = $1 ORDER BY version, seq",
      [key],
    );

  it("when the store opens on PostgreSQL, then its blobs are in the database by default", () => {
    expect(ctx.store.blobs).toBeInstanceOf(PgBlobStore);
  });

  it("when a blob is written, then it is one row per chunk of exactly the chunk size, and a stream yields them one at a time", async () => {
    await blobs.put("chunks/x", "0123456789abc");
    const rows = await chunkRows("chunks/x");
    expect(rows.map((r) => [r.seq, Number(r.size)])).toEqual([
      [0, 5],
      [1, 5],
      [2, 3],
    ]);
    const seen: string[] = [];
    for await (const chunk of (await blobs.stream("chunks/x"))!) seen.push(String(chunk));
    expect(seen).toEqual(["01234", "56789", "abc"]);
  });

  it("when a key is overwritten or a put fails, then only the current version's chunks are kept", async () => {
    await blobs.put("versions/x", "first version");
    await blobs.put("versions/x", "second version!");
    async function* broken() {
      yield Buffer.from("a third that never lands");
      throw new Error("cut off");
    }
    await expect(blobs.put("versions/x", broken())).rejects.toThrow("cut off");
    const rows = await chunkRows("versions/x");
    expect(new Set(rows.map((r) => r.version)).size).toBe(1);
    expect(rows).toHaveLength(3);
  });

  it("when two puts of one key overlap, then the last to commit wins and nothing is orphaned", async () => {
    const gates = [0, 1].map(() => {
      let open!: () => void;
      const opened = new Promise<void>((resolve) => {
        open = resolve;
      });
      return { open, opened };
    });
    const body = (label: string, gate: Promise<void>) =>
      (async function* () {
        yield Buffer.from(`${label}: first chunk, `);
        await gate;
        yield Buffer.from(`${label}: the rest`);
      })();
    const first = blobs.put("race/x", body("first", gates[0]!.opened));
    const second = blobs.put("race/x", body("second", gates[1]!.opened));
    gates[1]!.open();
    await second;
    gates[0]!.open();
    await first;
    expect((await blobs.get("race/x"))?.toString()).toBe("first: first chunk, first: the rest");
    const rows = await chunkRows("race/x");
    expect(new Set(rows.map((r) => r.version)).size).toBe(1);
  });

  it("when a blob is deleted while it is streamed, then the reader fails instead of getting a part", async () => {
    await blobs.put("gone/x", "abcdefghijklmnopqrst");
    const stream = (await blobs.stream("gone/x"))!;
    const iterator = stream[Symbol.asyncIterator]();
    expect(String((await iterator.next()).value)).toBe("abcde");
    await blobs.delete("gone/x");
    await expect(
      (async () => {
        for (;;) if ((await iterator.next()).done) return;
      })(),
    ).rejects.toBeInstanceOf(BlobChangedError);
    expect(await chunkRows("gone/x")).toEqual([]);
  });

  it("when a blob is overwritten between its lookup and its chunks, then get fails rather than mix versions", async () => {
    await blobs.put("mix/x", "aaaaaaaaaa");
    const other = new PgBlobStore(sql, ctx.now, { chunkBytes: CHUNK });
    // The lookup happens, then (before the first chunk's query) another put replaces it.
    const original = sql.pool.query.bind(sql.pool) as (...args: unknown[]) => Promise<unknown>;
    let replaced: Promise<unknown> | undefined;
    const spy = vi.spyOn(sql.pool, "query").mockImplementation(((...args: unknown[]) => {
      const config = args[0];
      if (typeof config !== "string" || !config.includes("FROM blob_chunks")) {
        return original(...args);
      }
      spy.mockRestore();
      replaced = other.put("mix/x", "bbbbbbbbbb");
      return replaced.then(() => original(...args));
    }) as never);
    await expect(blobs.get("mix/x")).rejects.toBeInstanceOf(BlobChangedError);
    await replaced;
    expect((await blobs.get("mix/x"))?.toString()).toBe("bbbbbbbbbb");
  });
});
