import { join } from "node:path";
import { Readable } from "node:stream";
import {
  assertBlobKey,
  assertBlobPrefix,
  type BlobBody,
  type BlobStore,
  bodyChunks,
  FsBlobStore,
} from "./blobs.ts";
import type { Clock } from "./common.ts";
import { uuidv7 } from "./ids.ts";
import { bytes, num, type RowOf, rowSchema, str } from "./rows.ts";
import type { PostgresSql } from "./sql.ts";

/** Chunk rows are this size (the last of a blob may be shorter). A chunk travels as hex text
 * twice its size; a streamed read held about 3 MiB with 256 KiB chunks and 7 MiB with 1 MiB
 * ones, at the same speed on a loaded machine (bench/blobs.ts). */
export const PG_BLOB_CHUNK_BYTES = 256 * 1024;

export interface PgBlobStoreOptions {
  /** Bytes per chunk row; tests make it small to cut blobs into many chunks. */
  chunkBytes?: number;
}

/** A blob of a version the store no longer has: it was overwritten or deleted mid-read. */
export class BlobChangedError extends Error {
  override name = "BlobChangedError";
  constructor(key: string) {
    super(`The blob ${key} was overwritten or deleted while it was read.`);
  }
}

/** The `blobs` table: each key's current version. */
const BLOBS = rowSchema({ key: str, version: str, bytes: num, chunks: num, modified_at: num });
/** What a read looks up first: the version it reads, and its size in bytes and in chunks. */
const HEAD = BLOBS.pick("version", "bytes", "chunks");
const INFO = BLOBS.pick("bytes", "modified_at");
const KEY = BLOBS.pick("key");
/** A row of `blob_chunks`: one chunk's bytes. */
const CHUNK = rowSchema({ data: bytes });

/**
 * Blobs in PostgreSQL (ADR 39), so that replicas on different machines share checkpoints and
 * datasets. A put writes a fresh version's chunk rows, points the key at that version and
 * deletes the key's other versions, all in one transaction: a reader sees the old bytes or the
 * new, and a writer killed mid-way leaves nothing (its transaction rolls back). A read looks up
 * the key's version once and then fetches that version's chunks one query each, so it holds no
 * connection between chunks and never mixes two versions; should the version go meanwhile (an
 * overwrite or a delete), the read fails with `BlobChangedError` instead of returning a part.
 */
export class PgBlobStore implements BlobStore {
  readonly #sql: PostgresSql;
  readonly #now: Clock;
  readonly #chunkBytes: number;

  constructor(sql: PostgresSql, now: Clock = Date.now, options: PgBlobStoreOptions = {}) {
    this.#sql = sql;
    this.#now = now;
    this.#chunkBytes = options.chunkBytes ?? PG_BLOB_CHUNK_BYTES;
  }

  async put(key: string, body: BlobBody): Promise<{ bytes: number }> {
    assertBlobKey(key);
    const version = uuidv7();
    return this.#sql.transaction(async (tx) => {
      let bytes = 0;
      let seq = 0;
      for await (const chunk of bodyChunks(body, this.#chunkBytes, true)) {
        await tx.exec("INSERT INTO blob_chunks (key, version, seq, data) VALUES ($1, $2, $3, $4)", [
          key,
          version,
          seq++,
          chunk,
        ]);
        bytes += chunk.byteLength;
      }
      // A concurrent put of the same key waits here for this one to commit (the key's row
      // lock), then deletes what this one wrote: the last to commit wins, nothing is orphaned.
      await tx.exec(
        `INSERT INTO blobs (key, version, bytes, chunks, modified_at) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (key) DO UPDATE SET version = EXCLUDED.version, bytes = EXCLUDED.bytes,
           chunks = EXCLUDED.chunks, modified_at = EXCLUDED.modified_at`,
        [key, version, bytes, seq, this.#now()],
      );
      await tx.exec("DELETE FROM blob_chunks WHERE key = $1 AND version <> $2", [key, version]);
      return { bytes };
    });
  }

  async get(key: string): Promise<Buffer | undefined> {
    const head = await this.#head(key);
    if (!head) return undefined;
    // One buffer of the blob's size, filled chunk by chunk: the blob is held once.
    const out = Buffer.allocUnsafeSlow(head.bytes);
    let filled = 0;
    for (let seq = 0; seq < head.chunks; seq++) {
      const chunk = await this.#chunk(key, head.version, seq);
      if (filled + chunk.byteLength > head.bytes) throw new BlobChangedError(key);
      out.set(chunk, filled);
      filled += chunk.byteLength;
    }
    if (filled !== head.bytes) throw new BlobChangedError(key);
    return out;
  }

  async stream(key: string): Promise<Readable | undefined> {
    const head = await this.#head(key);
    if (!head) return undefined;
    const chunk = (seq: number) => this.#chunk(key, head.version, seq);
    async function* chunks() {
      for (let seq = 0; seq < head!.chunks; seq++) yield await chunk(seq);
    }
    // Bytes, not objects, with a 1-byte mark: the next chunk is fetched only when the reader
    // has taken the last one.
    return Readable.from(chunks(), { objectMode: false, highWaterMark: 1 });
  }

  async exists(key: string): Promise<boolean> {
    assertBlobKey(key);
    return (
      (await this.#sql.one("SELECT 1 AS found FROM blobs WHERE key = $1", [key])) !== undefined
    );
  }

  async delete(key: string): Promise<boolean> {
    assertBlobKey(key);
    return this.#sql.transaction(async (tx) => {
      const deleted = await tx.exec("DELETE FROM blobs WHERE key = $1", [key]);
      await tx.exec("DELETE FROM blob_chunks WHERE key = $1", [key]);
      return deleted > 0;
    });
  }

  async deletePrefix(prefix: string): Promise<number> {
    if (prefix === "") throw new RangeError("deletePrefix needs a non-empty prefix");
    const [from, to] = range(prefix);
    return this.#sql.transaction(async (tx) => {
      const deleted = await tx.exec("DELETE FROM blobs WHERE key >= $1 AND key < $2", [from, to]);
      await tx.exec("DELETE FROM blob_chunks WHERE key >= $1 AND key < $2", [from, to]);
      return deleted;
    });
  }

  async list(prefix: string): Promise<string[]> {
    const [from, to] = range(prefix);
    const rows = await this.#sql.query(
      `SELECT ${KEY.columns()} FROM blobs WHERE key >= $1 AND key < $2 ORDER BY key`,
      [from, to],
    );
    return rows.map((r) => KEY.read(r).key);
  }

  async info(key: string): Promise<{ bytes: number; modifiedAt: number } | undefined> {
    assertBlobKey(key);
    const row = await this.#sql.one(`SELECT ${INFO.columns()} FROM blobs WHERE key = $1`, [key]);
    if (!row) return undefined;
    const info = INFO.read(row);
    return { bytes: info.bytes, modifiedAt: info.modified_at };
  }

  /** Nothing to sweep: a put that did not commit left no rows. */
  async sweepPartial(): Promise<string[]> {
    return [];
  }

  async #head(key: string): Promise<RowOf<typeof HEAD> | undefined> {
    assertBlobKey(key);
    const row = await this.#sql.one(`SELECT ${HEAD.columns()} FROM blobs WHERE key = $1`, [key]);
    return row ? HEAD.read(row) : undefined;
  }

  /** One chunk of one version. (It comes as hex text, which pg decodes into a Buffer: its
   * query-level binary results are decoded as UTF-8 text on a connection made for text.) */
  async #chunk(key: string, version: string, seq: number): Promise<Buffer> {
    const row = await this.#sql.one(
      `SELECT ${CHUNK.columns()} FROM blob_chunks WHERE key = $1 AND version = $2 AND seq = $3`,
      [key, version, seq],
    );
    if (!row) throw new BlobChangedError(key);
    return CHUNK.read(row).data;
  }
}

/** Keys that start with `prefix` are the range [prefix, prefix + DEL): key characters are
 * ASCII below DEL, and keys compare bytewise (COLLATE "C"). */
function range(prefix: string): [string, string] {
  assertBlobPrefix(prefix);
  return [prefix, `${prefix}\u007f`];
}

/**
 * A deployment on PostgreSQL that kept its files in `<dataDir>/blobs` before blobs moved into the
 * database by default (ADR 39): throws, so the process does not start, while that directory has
 * files and the database no checkpoint or dataset file yet, unless `chosen` (`ARBOR_BLOBS` was
 * set): serving then would answer every checkpoint and dataset as missing. Otherwise returns a
 * warning while the directory holds files this store does not read, or undefined.
 */
export async function checkFilesLeftInDataDir(
  store: { dialect: string; blobs: BlobStore },
  dataDir: string,
  chosen: boolean,
): Promise<string | undefined> {
  if (store.dialect !== "postgres" || store.blobs instanceof FsBlobStore) return;
  const dir = join(dataDir, "blobs");
  const files = await new FsBlobStore(dir).list("").catch(() => [] as string[]);
  if (files.length === 0) return;
  const how = `Copy them in with "arbor blobs import", or set ARBOR_BLOBS=fs to keep using the directory`;
  if (!chosen) {
    const stored = async (prefix: string) => (await store.blobs.list(prefix)).length > 0;
    if (!(await stored("checkpoints/")) && !(await stored("datasets/")))
      throw new Error(
        `${dir} holds ${files.length} checkpoint and dataset files, and PostgreSQL, where they are kept by default now (ARBOR_BLOBS), holds none. ${how} (or ARBOR_BLOBS=postgres to start without them).`,
      );
  }
  return `${dir} holds files this process does not read: checkpoints and datasets are kept in PostgreSQL (ARBOR_BLOBS). ${how}.`;
}
