import { join } from "node:path";
import {
  catalogModelDir,
  listCatalog,
  loadModel,
  type Model,
  type SftExample,
} from "@arbor/engine";
import type { Store } from "@arbor/store";
import { loadSftExamples } from "../datasets/fetch.ts";

export interface TrainingDataSettings {
  /** Largest `https://` training file fetched (bytes). */
  maxBytes: number;
  /** Hosts an `https://` training URL may name even when they resolve to private addresses. */
  allowHosts: readonly string[];
}

/** `dataset://` or `https://` → validated SFT examples (a bad line fails naming it). */
export function sftExamplesLoader(store: Store, settings: TrainingDataSettings) {
  return (entity: string, url: string): Promise<SftExample[]> =>
    loadSftExamples(store, entity, url, {
      maxBytes: settings.maxBytes,
      allowHosts: settings.allowHosts,
    });
}

/** The base models, each loaded once: the shipped ones, and the folders `<owner>/<name>/` under
 * `modelsDir` (the server's `ARBOR_BASE_MODELS_DIR`). A model that fails to load is tried again
 * by the next job. */
export function baseModels(modelsDir?: string): (baseId: string) => Promise<Model> {
  const loaded = new Map<string, Promise<Model>>();
  const shipped = new Set(listCatalog().map((e) => e.id));
  return (baseId) => {
    let model = loaded.get(baseId);
    if (!model) {
      const dir = shipped.has(baseId)
        ? catalogModelDir(baseId)
        : modelsDir && /^[^/]+\/[^/]+$/.test(baseId) && !baseId.includes("..")
          ? join(modelsDir, baseId)
          : undefined;
      model = dir ? loadModel(dir) : Promise.reject(new Error(`no base model ${baseId}`));
      model.catch(() => loaded.delete(baseId));
      loaded.set(baseId, model);
    }
    return model;
  };
}
