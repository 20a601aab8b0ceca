import { Readable } from "node:stream";
import {
  assertBlobKey,
  assertBlobPrefix,
  type BlobBody,
  type BlobStore,
  bodyChunks,
} from "./blobs.ts";
import type { Clock } from "./common.ts";

/** A stream hands out a blob in chunks of this size, as a file stream does. */
const STREAM_CHUNK_BYTES = 64 * 1024;

/**
 * Blobs kept in this process, for a store whose database is in memory too (SQLite `:memory:`
 * without a `blobDir`): they last as long as the store. A put gathers the whole body before it
 * replaces the key, so a reader sees the old bytes or the new ones, and a body that fails midway
 * leaves the old blob. Reads hand out copies: what a caller does with them never changes the blob.
 */
export class MemoryBlobStore implements BlobStore {
  readonly #blobs = new Map<string, { bytes: Buffer; modifiedAt: number }>();
  readonly #now: Clock;

  constructor(now: Clock = Date.now) {
    this.#now = now;
  }

  async put(key: string, body: BlobBody): Promise<{ bytes: number }> {
    assertBlobKey(key);
    const chunks: Uint8Array[] = [];
    for await (const chunk of bodyChunks(body, STREAM_CHUNK_BYTES)) chunks.push(chunk);
    const bytes = Buffer.concat(chunks);
    this.#blobs.set(key, { bytes, modifiedAt: this.#now() });
    return { bytes: bytes.byteLength };
  }

  async get(key: string): Promise<Buffer | undefined> {
    assertBlobKey(key);
    const blob = this.#blobs.get(key);
    return blob && Buffer.from(blob.bytes);
  }

  async stream(key: string): Promise<Readable | undefined> {
    assertBlobKey(key);
    const blob = this.#blobs.get(key);
    if (!blob) return undefined;
    async function* copies() {
      for await (const chunk of bodyChunks(blob!.bytes, STREAM_CHUNK_BYTES))
        yield Buffer.from(chunk);
    }
    return Readable.from(copies(), { objectMode: false });
  }

  async exists(key: string): Promise<boolean> {
    assertBlobKey(key);
    return this.#blobs.has(key);
  }

  async delete(key: string): Promise<boolean> {
    assertBlobKey(key);
    return this.#blobs.delete(key);
  }

  async deletePrefix(prefix: string): Promise<number> {
    if (prefix === "") throw new RangeError("deletePrefix needs a non-empty prefix");
    const keys = await this.list(prefix);
    for (const key of keys) this.#blobs.delete(key);
    return keys.length;
  }

  async list(prefix: string): Promise<string[]> {
    assertBlobPrefix(prefix);
    return [...this.#blobs.keys()].filter((key) => key.startsWith(prefix)).sort();
  }

  async info(key: string): Promise<{ bytes: number; modifiedAt: number } | undefined> {
    assertBlobKey(key);
    const blob = this.#blobs.get(key);
    return blob && { bytes: blob.bytes.byteLength, modifiedAt: blob.modifiedAt };
  }

  /** Nothing to sweep: a put that did not finish left nothing. */
  async sweepPartial(): Promise<string[]> {
    return [];
  }
}
