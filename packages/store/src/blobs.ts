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

const KEY = /^[A-Za-z0-9._\-=:@+]+(\/[A-Za-z0-9._\-=:@+]+)*$/;

export function assertBlobKey(key: string): void {
  if (!KEY.test(key) || key.split("/").some((part) => part === "." || part === "..")) {
    throw new RangeError(`Invalid blob key: ${JSON.stringify(key)}`);
  }
}

const TEMP_MARK = ".tmp-";
/** Partial files are named `<key>.tmp-<host>-<pid>-<random>`: a sweep tells whose they are. */
const HOST_TAG = createHash("sha256").update(hostname()).digest("hex").slice(0, 8);
const PARTIAL = /\.tmp-([0-9a-f]{8})-(\d+)-[0-9a-f]+$/;
const DAY_MS = 24 * 60 * 60 * 1000;

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
    await mkdir(dir, { recursive: true });
    const temp = `${path}${TEMP_MARK}${HOST_TAG}-${process.pid}-${randomBytes(6).toString("hex")}`;
    const file = await open(temp, "wx", 0o644);
    let bytes = 0;
    try {
      if (typeof body === "string" || body instanceof Uint8Array) {
        const buf = typeof body === "string" ? Buffer.from(body) : body;
        await file.writeFile(buf);
        bytes = buf.byteLength;
      } else {
        for await (const chunk of body as AsyncIterable<Uint8Array | string>) {
          const buf = typeof chunk === "string" ? Buffer.from(chunk) : chunk;
          await file.write(buf);
          bytes += buf.byteLength;
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
        const ours = host === HOST_TAG;
        const gone = ours
          ? Number(pid) !== process.pid && !processAlive(Number(pid))
          : now - (await stat(full).catch(() => ({ mtimeMs: now }))).mtimeMs > DAY_MS;
        if (!gone) continue;
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
      // Remove the emptied directory tree too, so deleted models leave nothing behind.
      await rm(this.#path(prefix.slice(0, -1)), { recursive: true, force: true });
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
