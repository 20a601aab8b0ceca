import { type CatalogEntry, catalogModelDir, EngineThread, listCatalog } from "@arbor/engine";
import type { BlobStore, Checkpoint } from "@arbor/store";
import { readCheckpointFiles } from "@arbor/training";
import type { LlamaCppBackend } from "./llama-cpp.ts";

/** Adapters kept loaded in each engine at once, most recently used first. */
const ADAPTER_CACHE_SIZE = 64;

/** A base model the server can serve, with when it was first seen. */
export interface BaseModel {
  entry: CatalogEntry;
  /** Unix seconds, for the `created` of model objects. */
  created: number;
}

export interface EngineHostOptions {
  /** The base models to serve; default the shipped catalogue. */
  catalog?: CatalogEntry[];
  /** User-supplied GGUF models (ARBOR_LLAMA_MODELS), served by llama.cpp. */
  llama?: Map<string, LlamaCppBackend>;
  /** Kernel threads of each engine (`engineThreads` of the configuration); default 1. */
  threads?: number;
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
  readonly #catalog: Map<string, BaseModel>;
  readonly #slots = new Map<string, Promise<Slot>>();
  readonly #llama: Map<string, LlamaCppBackend>;
  readonly #threads: number;

  constructor(options: EngineHostOptions = {}) {
    const created = catalogCreated;
    this.#catalog = new Map(
      (options.catalog ?? listCatalog()).map((entry) => [entry.id, { entry, created }]),
    );
    this.#llama = options.llama ?? new Map();
    this.#threads = options.threads ?? 1;
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

  baseModels(): BaseModel[] {
    return [...this.#catalog.values()];
  }

  baseModel(id: string): BaseModel | undefined {
    return this.#catalog.get(id);
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
    if (!this.#catalog.has(baseId)) throw new Error(`no base model ${baseId}`);
    const started = EngineThread.start(catalogModelDir(baseId), { threads: this.#threads }).then(
      (thread): Slot => ({ thread, adapters: new Map() }),
    );
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
  async adapter(
    baseId: string,
    checkpoint: Checkpoint,
    blobs: BlobStore | undefined,
  ): Promise<string | null> {
    if (!checkpoint.blob_key) return null;
    const slot = await this.#slot(baseId);
    const key = checkpoint.id;
    let loading = slot.adapters.get(key);
    if (loading) {
      slot.adapters.delete(key);
    } else {
      if (!blobs) throw new Error("the store has no blob directory");
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

/** The shipped catalogue's models are dated by the release that shipped them. */
const catalogCreated = Math.floor(Date.UTC(2026, 10, 23) / 1000);
