import { createReadStream } from "node:fs";
import { mkdtemp, readdir, rm, stat } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Worker } from "node:worker_threads";
import type { GgufOuttype } from "@arbor/engine/model";
import {
  type BlobStore,
  type Checkpoint,
  NotFoundError,
  WRITER_TAG,
  writerGone,
} from "@arbor/store";
import { digestTap } from "./adapters.ts";
import { ADAPTER_FILES, ownBuffer, readCheckpointFiles, withModelFiles } from "./checkpoints.ts";

/** A checkpoint export kept in the checkpoint's own folder (deleted with it). */
export interface StoredExport {
  key: string;
  bytes: number;
  /** RFC 9530 `sha-256=:<base64>:`. */
  digest: string;
}

const building = new Map<string, Promise<StoredExport>>();

/** What the export thread is told to write (besides the files and the path). */
interface ExportThreadData {
  kind: GgufExport;
  outtype: GgufOuttype;
  baseDir: string;
  name: string;
}

/** Exports are built in `<tmpdir>/arbor-export-<host>-<pid>-<random>/` (the writer's tag,
 * WRITER_TAG), so a sweep tells whose a folder is. */
const EXPORT_FOLDER = "arbor-export-";
const EXPORT_OWNER = /^arbor-export-([0-9a-f]{8})-(\d+)-/;

/** `gguf`: the base with the adapter merged in; `gguf-lora`: the adapter alone, for llama.cpp. */
export type GgufExport = "gguf" | "gguf-lora";

/** Each export's file beside the checkpoint's: the merged model per outtype, the adapter. */
function exportKey(blobKey: string, kind: GgufExport, outtype: GgufOuttype): string {
  if (kind === "gguf-lora") return `${blobKey}adapter.gguf`;
  return `${blobKey}${outtype === "f32" ? "merged.gguf" : `merged.${outtype}.gguf`}`;
}

/**
 * A checkpoint as GGUF that llama.cpp and Ollama load (`gguf`: one model, the base with the
 * adapter merged in, its weight matrices F32 or Q8_0 by `outtype`; `gguf-lora`: llama.cpp's
 * LoRA GGUF, to load beside the base's): built
 * once on a thread of its own (never on the caller's), written beside the checkpoint's files
 * with its length and digest, and reused by later downloads.
 */
export async function checkpointGguf(
  blobs: BlobStore,
  checkpoint: Checkpoint & { blob_key: string },
  kind: GgufExport,
  baseDir: string,
  name: string,
  outtype: GgufOuttype = "f32",
): Promise<StoredExport> {
  const key = exportKey(checkpoint.blob_key, kind, outtype);
  const metaKey = `${key}.json`;
  const meta = await blobs.get(metaKey);
  if (meta && (await blobs.exists(key))) {
    return { key, ...(JSON.parse(meta.toString()) as { bytes: number; digest: string }) };
  }
  let pending = building.get(key);
  if (!pending) {
    // Written beside the checkpoint's files: a delete of them waits for it, or came first.
    pending = withModelFiles(checkpoint.model_id, "write", () =>
      build(blobs, checkpoint, { kind, outtype, baseDir, name }, key, metaKey),
    ).finally(() => building.delete(key));
    building.set(key, pending);
  }
  return pending;
}

async function build(
  blobs: BlobStore,
  checkpoint: Checkpoint & { blob_key: string },
  { kind, outtype, baseDir, name }: ExportThreadData,
  key: string,
  metaKey: string,
): Promise<StoredExport> {
  const files = await readCheckpointFiles(blobs, checkpoint.blob_key, ADAPTER_FILES);
  if (ADAPTER_FILES.some((file) => !files[file])) {
    throw new NotFoundError(`Step ${checkpoint.step} has no weights: its files are gone.`, {
      code: "checkpoint_not_found",
    });
  }
  const dir = await mkdtemp(join(tmpdir(), `${EXPORT_FOLDER}${WRITER_TAG}-`));
  try {
    const path = join(dir, "export.gguf");
    // The adapter's bytes move to the thread (transferred, not copied): they are held once.
    const owned = Object.fromEntries(
      Object.entries(files).map(([file, bytes]) => [file, ownBuffer(bytes)]),
    );
    await new Promise<void>((resolve, reject) => {
      const worker = new Worker(new URL("./export-thread.ts", import.meta.url), {
        workerData: { kind, outtype, baseDir, files: owned, path, name },
        transferList: Object.values(owned).map((bytes) => bytes.buffer),
      });
      worker.once("error", reject);
      worker.once("exit", (code) =>
        code === 0 ? resolve() : reject(new Error(`the GGUF export thread exited with ${code}`)),
      );
    });
    // Hashed on its way into the store: one pass over the file.
    const { tap, digest: digestOf } = digestTap();
    const source = createReadStream(path);
    source.on("error", (err) => tap.destroy(err));
    const { bytes } = await blobs.put(key, source.pipe(tap));
    const digest = digestOf();
    await blobs.put(metaKey, JSON.stringify({ bytes, digest }));
    return { key, bytes, digest };
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

/**
 * Removes the export folders that builds cut off left in `root` (default the temp directory):
 * a process killed mid-export never reaches its own cleanup, and a merged GGUF is the size of
 * its model. A folder goes once its writer is gone (writerGone: a process of this host that no
 * longer runs), or, another host's or one named before the writer's tag was, once nothing in it
 * was written for a day. Returns the folders' names.
 */
export async function sweepExports(root = tmpdir(), now = Date.now()): Promise<string[]> {
  const removed: string[] = [];
  const names = await readdir(root).catch(() => [] as string[]);
  for (const name of names.filter((n) => n.startsWith(EXPORT_FOLDER))) {
    const dir = join(root, name);
    const [, host, pid] = EXPORT_OWNER.exec(name) ?? [];
    if (!writerGone(host, Number(pid), await lastWritten(dir), now)) continue;
    await rm(dir, { recursive: true, force: true });
    removed.push(name);
  }
  return removed;
}

/** When a folder or a file in it (the export being written) was last written. */
async function lastWritten(dir: string): Promise<number> {
  const times = [(await stat(dir).catch(() => undefined))?.mtimeMs ?? Date.now()];
  for (const entry of await readdir(dir).catch(() => [] as string[])) {
    const info = await stat(join(dir, entry)).catch(() => undefined);
    if (info) times.push(info.mtimeMs);
  }
  return Math.max(...times);
}
