import { createReadStream } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Worker } from "node:worker_threads";
import type { BlobStore, Checkpoint } from "@arbor/store";
import { digestTap } from "./adapters.ts";
import { ADAPTER_FILES, ownBuffer, readCheckpointFiles } from "./checkpoints.ts";

/** A checkpoint export kept in the checkpoint's own folder (deleted with it). */
export interface StoredExport {
  key: string;
  bytes: number;
  /** RFC 9530 `sha-256=:<base64>:`. */
  digest: string;
}

const building = new Map<string, Promise<StoredExport>>();

/** `gguf`: the base with the adapter merged in; `gguf-lora`: the adapter alone, for llama.cpp. */
export type GgufExport = "gguf" | "gguf-lora";

/**
 * A checkpoint as GGUF that llama.cpp and Ollama load (`gguf`: one F32 model, the base with
 * the adapter merged in; `gguf-lora`: llama.cpp's LoRA GGUF, to load beside the base's): built
 * once on a thread of its own (never on the caller's), written beside the checkpoint's files
 * with its length and digest, and reused by later downloads.
 */
export async function checkpointGguf(
  blobs: BlobStore,
  checkpoint: Checkpoint & { blob_key: string },
  kind: GgufExport,
  baseDir: string,
  name: string,
): Promise<StoredExport> {
  const key = `${checkpoint.blob_key}${kind === "gguf" ? "merged.gguf" : "adapter.gguf"}`;
  const metaKey = `${key}.json`;
  const meta = await blobs.get(metaKey);
  if (meta && (await blobs.exists(key))) {
    return { key, ...(JSON.parse(meta.toString()) as { bytes: number; digest: string }) };
  }
  let pending = building.get(key);
  if (!pending) {
    pending = build(blobs, checkpoint.blob_key, kind, baseDir, name, key, metaKey).finally(() =>
      building.delete(key),
    );
    building.set(key, pending);
  }
  return pending;
}

async function build(
  blobs: BlobStore,
  prefix: string,
  kind: GgufExport,
  baseDir: string,
  name: string,
  key: string,
  metaKey: string,
): Promise<StoredExport> {
  const files = await readCheckpointFiles(blobs, prefix, ADAPTER_FILES);
  const dir = await mkdtemp(join(tmpdir(), "arbor-export-"));
  try {
    const path = join(dir, "export.gguf");
    // The adapter's bytes move to the thread (transferred, not copied): they are held once.
    const owned = Object.fromEntries(
      Object.entries(files).map(([file, bytes]) => [file, ownBuffer(bytes)]),
    );
    await new Promise<void>((resolve, reject) => {
      const worker = new Worker(new URL("./export-thread.ts", import.meta.url), {
        workerData: { kind, baseDir, files: owned, path, name },
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
