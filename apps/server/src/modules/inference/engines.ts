import {
  type BaseModelFolder,
  type SkippedFolder,
  scanBaseModels,
  type WeightChoice,
} from "@arbor/engine/model";
import { EngineThread } from "@arbor/engine/serve";
import type { BlobStore, Checkpoint } from "@arbor/store";
import { readCheckpointFiles } from "@arbor/training";
import type { LlamaCppBackend } from "./llama-cpp.ts";

/** Adapters kept loaded in each engine at once, most recently used first. */
const ADAPTER_CACHE_SIZE = 64;

/** How long a scan of the base-model folders is trusted before a listing scans again. */
const RESCAN_MS = 10_000;

export interface EngineHostOptions {
  /** Where base-model folders are (`ARBOR_BASE_MODELS_DIR`); besides, the shipped models. */
  modelsDir?: string | undefined;
  /** User-supplied GGUF models (ARBOR_LLAMA_MODELS), served by llama.cpp. */
  llama?: Map<string, LlamaCppBackend>;
  /** Kernel threads of each engine (`engineThreads` of the configuration); default 1. */
  threads?: number;
  /** How each engine keeps the weights (`engineWeights` of the configuration); default auto. */
  weights?: WeightChoice;
}

/** One base model's engine thread and the adapters loaded into it. */
interface Slot {
  thread: EngineThread;
  adapters: Map<string, Promise<void>>;
}

/**
 * The embedded engines: one thread per base model, started on first use and kept (started
 * again should it die). Model compute never runs on the caller's thread.
 */
export class EngineHost {
  readonly #modelsDir: string | undefined;
  #models = new Map<string, BaseModelFolder>();
  #skipped: SkippedFolder[] = [];
  #scanned = 0;
  #scanning: Promise<void> | undefined;
  readonly #slots = new Map<string, Promise<Slot>>();
  readonly #llama: Map<string, LlamaCppBackend>;
  readonly #threads: number;
  readonly #weights: WeightChoice;

  constructor(options: EngineHostOptions = {}) {
    this.#modelsDir = options.modelsDir;
    this.#llama = options.llama ?? new Map();
    this.#threads = options.threads ?? 1;
    this.#weights = options.weights ?? "auto";
  }

  /**
   * Scans the base models (the shipped ones, and the folders under the models directory, each
   * checked without loading its weights); folders that cannot be served are kept aside with the
   * reason. Returns the newly skipped ones.
   */
  refresh(): Promise<void> {
    this.#scanning ??= scanBaseModels(this.#modelsDir, { weights: this.#weights })
      .then(({ models, skipped }) => {
        this.#models = new Map(models.map((m) => [m.id, m]));
        this.#skipped = skipped;
        this.#scanned = Date.now();
      })
      .finally(() => {
        this.#scanning = undefined;
      });
    return this.#scanning;
  }

  /** The base models as of a recent scan (scanning again first when the last is stale). */
  async current(): Promise<BaseModelFolder[]> {
    if (Date.now() - this.#scanned > RESCAN_MS) await this.refresh();
    return [...this.#models.values()];
  }

  /** A base model by id; an id not seen is looked for again (a folder just added). */
  async find(id: string): Promise<BaseModelFolder | undefined> {
    if (!this.#models.has(id) && Date.now() - this.#scanned > 1000) await this.refresh();
    return this.#models.get(id);
  }

  /** Where base-model folders are, when there is such a directory. */
  get modelsDir(): string | undefined {
    return this.#modelsDir;
  }

  /** How the engines keep weights (what fits depends on it). */
  get weights(): WeightChoice {
    return this.#weights;
  }

  /** Folders under the models directory that cannot be served, and why. */
  get skipped(): readonly SkippedFolder[] {
    return this.#skipped;
  }

  llamaModels(): ReadonlyMap<string, LlamaCppBackend> {
    return this.#llama;
  }

  async dispose(): Promise<void> {
    const slots = await Promise.allSettled(this.#slots.values());
    await Promise.all([
      ...[...this.#llama.values()].map((b) => b.dispose()),
      ...slots.flatMap((s) => (s.status === "fulfilled" ? [s.value.thread.dispose()] : [])),
    ]);
  }

  /** The base models of the last scan. */
  baseModels(): BaseModelFolder[] {
    return [...this.#models.values()];
  }

  /** The engine serving `baseId`; starts its thread (loading the model) the first time. */
  async engine(baseId: string): Promise<EngineThread> {
    return (await this.#slot(baseId)).thread;
  }

  async #slot(baseId: string): Promise<Slot> {
    const existing = this.#slots.get(baseId);
    if (existing) {
      const slot = await existing.catch(() => undefined);
      if (slot && !slot.thread.failed) return slot;
      if (this.#slots.get(baseId) === existing) this.#slots.delete(baseId);
      return this.#slot(baseId);
    }
    const base = this.#models.get(baseId);
    if (!base) throw new Error(`no base model ${baseId}`);
    const started = EngineThread.start(base.dir, {
      threads: this.#threads,
      weights: this.#weights,
    }).then((thread): Slot => ({ thread, adapters: new Map() }));
    started.catch(() => {
      if (this.#slots.get(baseId) === started) this.#slots.delete(baseId);
    });
    this.#slots.set(baseId, started);
    return started;
  }

  /**
   * The key a trained checkpoint's adapter serves under, loaded into the engine from its files
   * once and shared by every request: one base model in memory, many adapters beside it. A
   * checkpoint without files (step 0) is the identity: the base model itself (null).
   */
  async adapter(baseId: string, checkpoint: Checkpoint, blobs: BlobStore): Promise<string | null> {
    if (!checkpoint.blob_key) return null;
    const slot = await this.#slot(baseId);
    const key = checkpoint.id;
    let loading = slot.adapters.get(key);
    if (loading) {
      slot.adapters.delete(key);
    } else {
      const prefix = checkpoint.blob_key;
      loading = readCheckpointFiles(blobs, prefix).then((files) => {
        // Deleted since the request resolved it: its rows go first, then its files.
        if (!files["adapter_model.safetensors"]) throw new CheckpointGoneError(checkpoint.id);
        return slot.thread.loadAdapter(key, files);
      });
      loading.catch(() => slot.adapters.delete(key));
    }
    slot.adapters.set(key, loading);
    if (slot.adapters.size > ADAPTER_CACHE_SIZE) {
      const oldest = slot.adapters.keys().next().value!;
      slot.adapters.delete(oldest);
      slot.thread.dropAdapter(oldest);
    }
    await loading;
    return key;
  }

  /** Started engines, for tests and metrics. */
  async loaded(): Promise<EngineThread[]> {
    const slots = await Promise.allSettled(this.#slots.values());
    return slots.flatMap((s) => (s.status === "fulfilled" ? [s.value.thread] : []));
  }
}

/** A checkpoint's files are gone: it was deleted while a request was resolving it. */
export class CheckpointGoneError extends Error {
  override name = "CheckpointGoneError";
  constructor(checkpointId: string) {
    super(`checkpoint ${checkpointId} has no files`);
  }
}
