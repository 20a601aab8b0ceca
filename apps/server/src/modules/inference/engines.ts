import { type CatalogEntry, catalogModelDir, Engine, listCatalog, loadModel } from "@arbor/engine";

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

  constructor(catalog: CatalogEntry[] = listCatalog(), created = catalogCreated) {
    this.#catalog = new Map(catalog.map((entry) => [entry.id, { entry, created }]));
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

  /** Loaded engines, for tests and metrics. */
  loaded(): Promise<Engine[]> {
    return Promise.all(this.#engines.values());
  }
}

/** The shipped catalogue's models are dated by the release that shipped them. */
const catalogCreated = Math.floor(Date.UTC(2026, 10, 23) / 1000);
