import { join } from "node:path";
import {
  catalogModelDir,
  type Kernels,
  listCatalog,
  loadModel,
  type Model,
  type SftExample,
  type WeightDtype,
} from "@arbor/engine";
import type { Store } from "@arbor/store";
import { loadTrainingData } from "../datasets/fetch.ts";
import { sftExamples } from "../datasets/jsonl.ts";

export interface TrainingDataSettings {
  /** Largest `https://` training file fetched (bytes). */
  maxBytes: number;
  /** Hosts an `https://` training URL may name even when they resolve to private addresses. */
  allowHosts: readonly string[];
}

/** `dataset://` or `https://` → validated SFT examples (a bad line fails naming it). */
export function sftExamplesLoader(store: Store, settings: TrainingDataSettings) {
  return async (entity: string, url: string): Promise<SftExample[]> => {
    const text = await loadTrainingData(store, entity, url, {
      maxBytes: settings.maxBytes,
      allowHosts: settings.allowHosts,
    });
    return sftExamples(text);
  };
}

/** The base models, each loaded once per kernel set, its weights packed in those kernels as
 * their only copy (`weights`: F32, or BF16 widened inside the kernels): the shipped ones, and
 * the folders `<owner>/<name>/` under `modelsDir` (the server's `ARBOR_BASE_MODELS_DIR`). A
 * model that fails to load is tried again by the next job. */
export function baseModels(
  modelsDir?: string,
  options: { weights?: WeightDtype } = {},
): (baseId: string, kernels: Kernels) => Promise<Model> {
  const loaded = new WeakMap<Kernels, Map<string, Promise<Model>>>();
  const shipped = new Set(listCatalog().map((e) => e.id));
  return (baseId, kernels) => {
    let models = loaded.get(kernels);
    if (!models) {
      models = new Map();
      loaded.set(kernels, models);
    }
    let model = models.get(baseId);
    if (!model) {
      const dir = shipped.has(baseId)
        ? catalogModelDir(baseId)
        : modelsDir && /^[^/]+\/[^/]+$/.test(baseId) && !baseId.includes("..")
          ? join(modelsDir, baseId)
          : undefined;
      model = dir
        ? loadModel(dir, { kernels, weights: options.weights ?? "f32" })
        : Promise.reject(new Error(`no base model ${baseId}`));
      const cache = models;
      model.catch(() => cache.delete(baseId));
      models.set(baseId, model);
    }
    return model;
  };
}
