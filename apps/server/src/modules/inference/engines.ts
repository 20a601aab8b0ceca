import {
  adapterFromFiles,
  type CatalogEntry,
  catalogModelDir,
  Engine,
  type LoraAdapter,
  listCatalog,
  loadModel,
} from "@arbor/engine";
import type { BlobStore, Checkpoint } from "@arbor/store";
import { readCheckpointFiles } from "@arbor/worker";
import type { LlamaCppBackend } from "./llama-cpp.ts";

/** Adapters kept in memory at once, most recently used first. */
const ADAPTER_CACHE_SIZE = 64;

/** A base model the server can serve, with when it was first seen. */
export interface BaseModel {
  entry: CatalogEntry;
  /** Unix seconds, for the `created` of model objects. */
  created: number;
}

/** The embedded engines: one per base model, loaded on first use and kept. */
export class EngineHost {
  readonly #catalog: Map<string, BaseModel>;
  readonly #engines = new Map<string, Promise<Engine>>();
  readonly #adapters = new Map<string, Promise<LoraAdapter>>();

  readonly #llama: Map<string, LlamaCppBackend>;

  /** `llama`: user-supplied GGUF models (ARBOR_LLAMA_MODELS), served by llama.cpp. */
  constructor(
    catalog: CatalogEntry[] = listCatalog(),
    llama: Map<string, LlamaCppBackend> = new Map(),
    created = catalogCreated,
  ) {
    this.#catalog = new Map(catalog.map((entry) => [entry.id, { entry, created }]));
    this.#llama = llama;
  }

  llamaModels(): ReadonlyMap<string, LlamaCppBackend> {
    return this.#llama;
  }

  async dispose(): Promise<void> {
    const engines = await Promise.allSettled(this.#engines.values());
    await Promise.all([
      ...[...this.#llama.values()].map((b) => b.dispose()),
      ...engines.flatMap((e) => (e.status === "fulfilled" ? [e.value.dispose()] : [])),
    ]);
  }

  baseModels(): BaseModel[] {
    return [...this.#catalog.values()];
  }

  baseModel(id: string): BaseModel | undefined {
    return this.#catalog.get(id);
  }

  /** The engine serving `baseId`; loads the model the first time. */
  engine(baseId: string): Promise<Engine> {
    let engine = this.#engines.get(baseId);
    if (!engine) {
      if (!this.#catalog.has(baseId)) throw new Error(`no base model ${baseId}`);
      engine = loadModel(catalogModelDir(baseId)).then((model) => new Engine(model));
      engine.catch(() => this.#engines.delete(baseId));
      this.#engines.set(baseId, engine);
    }
    return engine;
  }

  /** The adapter a trained checkpoint serves with, loaded from its files once and shared by
   * every request: one base model in memory, many adapters beside it. A checkpoint without
   * files (step 0) is the identity: the base model itself. */
  async adapter(
    baseId: string,
    checkpoint: Checkpoint,
    blobs: BlobStore | undefined,
  ): Promise<LoraAdapter | null> {
    if (!checkpoint.blob_key) return null;
    const key = checkpoint.id;
    let adapter = this.#adapters.get(key);
    if (adapter) {
      this.#adapters.delete(key);
    } else {
      const prefix = checkpoint.blob_key;
      if (!blobs) throw new Error("the store has no blob directory");
      adapter = Promise.all([this.engine(baseId), readCheckpointFiles(blobs, prefix)]).then(
        ([engine, files]) => {
          // Deleted since the request resolved it: its rows go first, then its files.
          if (!files["adapter_model.safetensors"]) throw new CheckpointGoneError(checkpoint.id);
          return adapterFromFiles(files, engine.model);
        },
      );
      adapter.catch(() => this.#adapters.delete(key));
    }
    this.#adapters.set(key, adapter);
    if (this.#adapters.size > ADAPTER_CACHE_SIZE)
      this.#adapters.delete(this.#adapters.keys().next().value!);
    return adapter;
  }

  /** Loaded engines, for tests and metrics. */
  loaded(): Promise<Engine[]> {
    return Promise.all(this.#engines.values());
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
