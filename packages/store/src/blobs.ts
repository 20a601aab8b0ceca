import { createHash, randomBytes } from "node:crypto";
import { createReadStream } from "node:fs";
import { mkdir, open, readdir, readFile, rename, rm, rmdir, stat, unlink } from "node:fs/promises";
import { hostname } from "node:os";
import { dirname, join, relative, sep } from "node:path";
import type { Readable } from "node:stream";

export type BlobBody = Uint8Array | string | AsyncIterable<Uint8Array> | Readable;

/**
 * Where checkpoint and dataset files live. Keys are `/`-separated relative paths such as
 * `models/<id>/checkpoints/3/adapter_model.safetensors`. A put is atomic: a reader sees the old
 * bytes or the new ones, never a part. Write the blob first, then the row that names it.
 * Implementations: `FsBlobStore` (the data directory), `PgBlobStore` (PostgreSQL, ADR 39) and
 * `MemoryBlobStore` (beside an in-memory database, ADR 55); `openStore` chooses. `get` holds the
 * whole blob once; `stream` holds about one chunk.
 */
export interface BlobStore {
  put(key: string, body: BlobBody): Promise<{ bytes: number }>;
  get(key: string): Promise<Buffer | undefined>;
  stream(key: string): Promise<Readable | undefined>;
  exists(key: string): Promise<boolean>;
  delete(key: string): Promise<boolean>;
  /** Deletes every key starting with `prefix`; returns how many. */
  deletePrefix(prefix: string): Promise<number>;
  list(prefix: string): Promise<string[]>;
  /** The blob's size and when it was last written (Unix ms), or undefined when it does not exist. */
  info(key: string): Promise<{ bytes: number; modifiedAt: number } | undefined>;
  /**
   * Removes what interrupted writes left behind: partial files of writers that are gone (a
   * process of this host that no longer runs, or anything a day old). Returns their names.
   */
  sweepPartial(): Promise<string[]>;
}

/** The characters of a key's parts. */
const KEY_CHAR = "[A-Za-z0-9._\\-=:@+]";
const KEY = new RegExp(`^${KEY_CHAR}+(\\/${KEY_CHAR}+)*$`);
const PREFIX = new RegExp(`^(${KEY_CHAR}|\\/)*$`);

export function assertBlobKey(key: string): void {
  if (!KEY.test(key) || key.split("/").some((part) => part === "." || part === "..")) {
    throw new RangeError(`Invalid blob key: ${JSON.stringify(key)}`);
  }
}

/** A listing prefix: key characters and slashes (a partial key). */
export function assertBlobPrefix(prefix: string): void {
  if (!PREFIX.test(prefix)) throw new RangeError(`Invalid blob prefix: ${JSON.stringify(prefix)}`);
}

const TEMP_MARK = ".tmp-";
const HOST_TAG = createHash("sha256").update(hostname()).digest("hex").slice(0, 8);
/** This process as the writer of a partial file or temporary folder, `<host>-<pid>`: written
 * into their names (`<key>.tmp-<host>-<pid>-<random>`, `arbor-export-<host>-<pid>-…`), so a
 * sweep tells whose they are. */
export const WRITER_TAG = `${HOST_TAG}-${process.pid}`;
const PARTIAL = /\.tmp-([0-9a-f]{8})-(\d+)-[0-9a-f]+$/;
const DAY_MS = 24 * 60 * 60 * 1000;

/** When this process started (Unix ms), less a margin for coarse file times: what this pid
 * last wrote before then, an earlier process with the same pid wrote (a container's server is
 * often pid 1 on every start). */
const STARTED_MS = Date.now() - process.uptime() * 1000 - 5_000;

/**
 * Whether what a writer left (its tag's `host` and `pid`, last written at `modifiedAt`) is
 * abandoned: its writer is a process of this host that no longer runs (another pid that is not
 * alive, or this pid before this process started), or it is a day old (another host's, whose
 * processes cannot be seen from here).
 */
export function writerGone(
  host: string | undefined,
  pid: number,
  modifiedAt: number,
  now = Date.now(),
): boolean {
  if (now - modifiedAt > DAY_MS) return true;
  if (host !== HOST_TAG) return false;
  return pid === process.pid ? modifiedAt < STARTED_MS : !processAlive(pid);
}

/** The data-directory implementation: temp file in the same dir, fsync, rename, fsync dir. */
export class FsBlobStore implements BlobStore {
  readonly root: string;
  constructor(root: string) {
    this.root = root;
  }

  #path(key: string): string {
    assertBlobKey(key);
    return join(this.root, ...key.split("/"));
  }

  async put(key: string, body: BlobBody): Promise<{ bytes: number }> {
    const path = this.#path(key);
    const dir = dirname(path);
    const temp = `${path}${TEMP_MARK}${WRITER_TAG}-${randomBytes(6).toString("hex")}`;
    const file = await openIn(dir, temp);
    let bytes = 0;
    try {
      if (body instanceof Uint8Array) {
        await file.writeFile(body);
        bytes = body.byteLength;
      } else {
        // A string is encoded a slice at a time: never a second whole copy of it.
        for await (const chunk of bodyChunks(body, STRING_SLICE_BYTES)) {
          await file.write(chunk);
          bytes += chunk.byteLength;
        }
      }
      await file.sync();
    } catch (err) {
      await file.close();
      await unlink(temp).catch(() => {});
      throw err;
    }
    await file.close();
    await rename(temp, path);
    await syncDir(dir);
    return { bytes };
  }

  async get(key: string): Promise<Buffer | undefined> {
    try {
      return await readFile(this.#path(key));
    } catch (err) {
      if (isMissing(err)) return undefined;
      throw err;
    }
  }

  async stream(key: string): Promise<Readable | undefined> {
    const path = this.#path(key);
    if (!(await this.exists(key))) return undefined;
    return createReadStream(path);
  }

  async exists(key: string): Promise<boolean> {
    try {
      return (await stat(this.#path(key))).isFile();
    } catch (err) {
      if (isMissing(err)) return false;
      throw err;
    }
  }

  async delete(key: string): Promise<boolean> {
    try {
      await unlink(this.#path(key));
      return true;
    } catch (err) {
      if (isMissing(err)) return false;
      throw err;
    }
  }

  async list(prefix: string): Promise<string[]> {
    const out: string[] = [];
    const dirPart = prefix.includes("/") ? prefix.slice(0, prefix.lastIndexOf("/")) : "";
    if (dirPart) assertBlobKey(dirPart);
    await this.#walk(join(this.root, ...dirPart.split("/").filter(Boolean)), (key) => {
      if (key.startsWith(prefix)) out.push(key);
    });
    return out.sort();
  }

  async info(key: string): Promise<{ bytes: number; modifiedAt: number } | undefined> {
    try {
      const { size, mtimeMs } = await stat(this.#path(key));
      return { bytes: size, modifiedAt: mtimeMs };
    } catch (err) {
      if (isMissing(err)) return undefined;
      throw err;
    }
  }

  async sweepPartial(): Promise<string[]> {
    const removed: string[] = [];
    const now = Date.now();
    const visit = async (dir: string): Promise<void> => {
      let entries: import("node:fs").Dirent[];
      try {
        entries = await readdir(dir, { withFileTypes: true });
      } catch (err) {
        if (isMissing(err)) return;
        throw err;
      }
      for (const entry of entries) {
        const full = join(dir, entry.name);
        if (entry.isDirectory()) {
          await visit(full);
          continue;
        }
        if (!entry.name.includes(TEMP_MARK)) continue;
        const [, host, pid] = PARTIAL.exec(entry.name) ?? [];
        const modifiedAt = (await stat(full).catch(() => ({ mtimeMs: now }))).mtimeMs;
        if (!writerGone(host, Number(pid), modifiedAt, now)) continue;
        await unlink(full).catch(() => {});
        await removeEmptyDirs(dir, this.root);
        removed.push(relative(this.root, full).split(sep).join("/"));
      }
    };
    await visit(this.root);
    return removed;
  }

  async deletePrefix(prefix: string): Promise<number> {
    if (prefix === "") throw new RangeError("deletePrefix needs a non-empty prefix");
    const keys = await this.list(prefix);
    for (const key of keys) await this.delete(key);
    if (prefix.endsWith("/")) {
      // Remove the emptied directory tree too, so deleted models leave nothing behind, and the
      // folders it emptied above it. A file another process writes into the tree meanwhile
      // (ENOTEMPTY) is removed by the retries; that write then fails.
      const dir = this.#path(prefix.slice(0, -1));
      await rm(dir, { recursive: true, force: true, maxRetries: 5, retryDelay: 10 });
      await removeEmptyDirs(dirname(dir), this.root);
    } else {
      await removeEmptyDirs(dirname(this.#path(keys[0] ?? `${prefix}x`)), this.root);
    }
    return keys.length;
  }

  async #walk(dir: string, visit: (key: string) => void): Promise<void> {
    let entries: import("node:fs").Dirent[];
    try {
      entries = await readdir(dir, { withFileTypes: true });
    } catch (err) {
      if (isMissing(err) || (err as { code?: string }).code === "ENOTDIR") return;
      throw err;
    }
    for (const entry of entries) {
      const full = join(dir, entry.name);
      if (entry.isDirectory()) await this.#walk(full, visit);
      else if (entry.isFile() && !entry.name.includes(TEMP_MARK)) {
        visit(relative(this.root, full).split(sep).join("/"));
      }
    }
  }
}

/** Encoded slices of a string body are about this size. */
const STRING_SLICE_BYTES = 1024 * 1024;

/**
 * A body as a sequence of byte chunks, holding at most one chunk besides the body itself:
 * bytes are cut into views (no copy), a string is encoded a slice at a time (never split inside
 * a surrogate pair), and a stream's pieces are passed on as they come. With `exact`, chunks are
 * `size` bytes each but the last (stream pieces are gathered or cut to that size).
 */
export async function* bodyChunks(
  body: BlobBody,
  size: number,
  exact = false,
): AsyncGenerator<Uint8Array> {
  if (body instanceof Uint8Array) {
    for (let at = 0; at < body.byteLength; at += size) {
      yield body.subarray(at, Math.min(body.byteLength, at + size));
    }
    return;
  }
  if (typeof body === "string") {
    // A UTF-16 unit is at most 3 bytes of UTF-8 (a surrogate pair, 2 units, is 4).
    const units = Math.max(2, Math.floor(size / 3));
    const slices = (async function* () {
      for (let at = 0; at < body.length; ) {
        let end = Math.min(body.length, at + units);
        const last = body.charCodeAt(end - 1);
        if (end < body.length && last >= 0xd800 && last <= 0xdbff) end--;
        yield Buffer.from(body.slice(at, end));
        at = end;
      }
    })();
    yield* exact ? regroup(slices, size) : slices;
    return;
  }
  const pieces = (async function* () {
    for await (const piece of body as AsyncIterable<Uint8Array | string>) {
      yield typeof piece === "string" ? Buffer.from(piece) : piece;
    }
  })();
  yield* exact ? regroup(pieces, size) : pieces;
}

/** Pieces of any size → chunks of exactly `size` bytes (the last may be shorter). */
async function* regroup(pieces: AsyncIterable<Uint8Array>, size: number) {
  let chunk = Buffer.allocUnsafe(size);
  let filled = 0;
  for await (const piece of pieces) {
    for (let at = 0; at < piece.byteLength; ) {
      const take = Math.min(size - filled, piece.byteLength - at);
      chunk.set(piece.subarray(at, at + take), filled);
      filled += take;
      at += take;
      if (filled === size) {
        yield chunk;
        chunk = Buffer.allocUnsafe(size);
        filled = 0;
      }
    }
  }
  if (filled > 0) yield chunk.subarray(0, filled);
}

/** Creates `temp` in `dir` (made when missing) for writing. A delete of the directory's tree, or
 * of the empty folders above it, may remove it between the two steps: then both are tried again. */
async function openIn(dir: string, temp: string) {
  for (let attempt = 1; ; attempt++) {
    try {
      await mkdir(dir, { recursive: true });
      return await open(temp, "wx", 0o644);
    } catch (err) {
      if (!isMissing(err) || attempt === 5) throw err;
    }
  }
}

async function syncDir(dir: string): Promise<void> {
  const handle = await open(dir, "r");
  try {
    await handle.sync();
  } catch (err) {
    // Some filesystems refuse fsync on a directory; the rename is still atomic there.
    if ((err as { code?: string }).code !== "EINVAL") throw err;
  } finally {
    await handle.close();
  }
}

async function removeEmptyDirs(dir: string, root: string): Promise<void> {
  let current = dir;
  while (current.startsWith(root) && current !== root) {
    try {
      await rmdir(current);
    } catch {
      return;
    }
    current = dirname(current);
  }
}

function processAlive(pid: number): boolean {
  if (!Number.isInteger(pid) || pid <= 0) return false;
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === "EPERM";
  }
}

function isMissing(err: unknown): boolean {
  return (err as { code?: string }).code === "ENOENT";
}
