import type { BlobStore, Store, TrainingJob } from "@arbor/store";
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
 * which the caller then records in the checkpoint row: files first, then the row. A write that
 * fails takes the files written before it away too. */
export async function writeCheckpointFiles(
  blobs: BlobStore,
  modelId: string,
  step: number,
  files: CheckpointFiles,
): Promise<string> {
  return writeFilesAt(blobs, `${modelFilesPrefix(modelId)}${step}-${uuidv7()}/`, files);
}

/** Writes files under a fresh `prefix` (each write atomic) and returns it; a write that fails
 * takes the files written before it away too. */
export async function writeFilesAt(
  blobs: BlobStore,
  prefix: string,
  files: CheckpointFiles,
): Promise<string> {
  try {
    for (const [name, bytes] of Object.entries(files)) await blobs.put(`${prefix}${name}`, bytes);
  } catch (err) {
    await blobs.deletePrefix(prefix).catch(() => 0);
    throw err;
  }
  return prefix;
}

/** A training job of the model that is running (else queued), which writes its checkpoints
 * meanwhile: a write of another checkpoint would collide with its steps. */
export async function activeJobOf(
  store: Store,
  entity: string,
  modelId: string,
): Promise<{ job: TrainingJob; status: "running" | "queued" } | undefined> {
  for (const status of ["running", "queued"] as const) {
    const job = (await store.jobs.list(entity, { model_id: modelId, status, limit: 1 })).data[0];
    if (job) return { job, status };
  }
  return undefined;
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

/** Who is using a model's files: writers of new files (adapter uploads, GGUF exports), who
 * share them, or a delete (of the model, or of some of its checkpoints), who has them alone. */
export type ModelFilesUse = "write" | "delete";

interface ModelFilesState {
  writers: number;
  deleting: boolean;
  /** In arrival order: a delete waiting keeps later writers waiting behind it. */
  waiting: { use: ModelFilesUse; grant: () => void }[];
}

const modelFiles = new Map<string, ModelFilesState>();

/**
 * Runs `fn` with the model's files held for `use`, in this process: writers run side by side,
 * a delete runs alone, so a delete never removes a folder a write is filling in (in files, the
 * write failed with ENOENT and the delete with ENOTEMPTY) and no upload lands half before and
 * half after it. Across processes the store's transactions and the file store's retries hold
 * instead (a write cut off there fails, and its upload answers as the model now is).
 */
export async function withModelFiles<T>(
  modelId: string,
  use: ModelFilesUse,
  fn: () => Promise<T>,
): Promise<T> {
  let state = modelFiles.get(modelId);
  if (!state) {
    state = { writers: 0, deleting: false, waiting: [] };
    modelFiles.set(modelId, state);
  }
  const held = state;
  const free =
    held.waiting.length === 0 && !held.deleting && (use === "write" || held.writers === 0);
  if (free) take(held, use);
  else await new Promise<void>((grant) => held.waiting.push({ use, grant }));
  try {
    return await fn();
  } finally {
    if (use === "delete") held.deleting = false;
    else held.writers--;
    // The next delete once no one holds the files, else every writer up to it.
    for (let next = held.waiting[0]; next && !held.deleting; next = held.waiting[0]) {
      if (next.use === "delete" && held.writers > 0) break;
      held.waiting.shift();
      take(held, next.use);
      next.grant();
    }
    if (!held.deleting && held.writers === 0 && held.waiting.length === 0)
      modelFiles.delete(modelId);
  }
}

function take(state: ModelFilesState, use: ModelFilesUse): void {
  if (use === "delete") state.deleting = true;
  else state.writers++;
}
