import type { BlobStore } from "@arbor/store";
import { uuidv7 } from "@arbor/store";

/** The PEFT adapter files, plus the optimizer state a resumed job continues from. */
export const ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"] as const;
export const OPTIMIZER_FILE = "optimizer.bin";

export type CheckpointFiles = Record<string, Uint8Array>;

/** Checkpoint files live under `checkpoints/<model id>/<step>-<uuid>/`. */
export const CHECKPOINTS_PREFIX = "checkpoints/";

/** Every file of a model's checkpoints, under one prefix (deleted with the model). */
export function modelFilesPrefix(modelId: string): string {
  return `${CHECKPOINTS_PREFIX}${modelId}/`;
}

/** Writes a checkpoint's files under a fresh prefix (each write atomic) and returns the prefix,
 * which the caller then records in the checkpoint row: files first, then the row. */
export async function writeCheckpointFiles(
  blobs: BlobStore,
  modelId: string,
  step: number,
  files: CheckpointFiles,
): Promise<string> {
  const prefix = `${modelFilesPrefix(modelId)}${step}-${uuidv7()}/`;
  for (const [name, bytes] of Object.entries(files)) await blobs.put(`${prefix}${name}`, bytes);
  return prefix;
}

/** Reads what a checkpoint has of `names`. */
export async function readCheckpointFiles(
  blobs: BlobStore,
  prefix: string,
  names: readonly string[] = [...ADAPTER_FILES, OPTIMIZER_FILE],
): Promise<CheckpointFiles> {
  const files: CheckpointFiles = {};
  for (const name of names) {
    const bytes = await blobs.get(`${prefix}${name}`);
    if (bytes) files[name] = bytes;
  }
  return files;
}

/** `bytes` over an ArrayBuffer of its own, which can be transferred to a thread: a view of a
 * shared pool (small Buffers) is copied first. */
export function ownBuffer(bytes: Uint8Array): Uint8Array<ArrayBuffer> {
  const whole =
    bytes.buffer instanceof ArrayBuffer &&
    bytes.byteOffset === 0 &&
    bytes.byteLength === bytes.buffer.byteLength;
  return whole ? (bytes as Uint8Array<ArrayBuffer>) : new Uint8Array(bytes);
}
