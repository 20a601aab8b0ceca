import { join } from "node:path";
import type { Kernels } from "@arbor/engine/kernels";
import {
  catalogModelDir,
  listCatalog,
  loadModel,
  type Model,
  releaseModel,
  type WeightChoice,
} from "@arbor/engine/model";
import type { DpoPair, SftExample } from "@arbor/engine/train";
import type { Store } from "@arbor/store";
import { loadDpoPairs, loadSftExamples } from "../datasets/fetch.ts";

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

/** `dataset://` or `https://` → validated DPO preference pairs (a bad line fails naming it). */
export function dpoPairsLoader(store: Store, settings: TrainingDataSettings) {
  return (entity: string, url: string): Promise<DpoPair[]> =>
    loadDpoPairs(store, entity, url, {
      maxBytes: settings.maxBytes,
      allowHosts: settings.allowHosts,
    });
}

/** The base models, each loaded into a kernel set with its weights packed in those kernels as
 * their only copy (`weights`: F32, BF16 widened inside the kernels, or `auto`: BF16 for BF16
 * files, else F32): the shipped ones, and
 * the folders `<owner>/<name>/` under `modelsDir` (the server's `ARBOR_BASE_MODELS_DIR`). A
 * kernel set keeps one base model at a time (jobs run one after another): loading another
 * frees the previous one's memory first, so the arena plan of a job (`trainingMemory`) is what
 * its arena holds. A model that fails to load is tried again by the next job. */
export function baseModels(
  modelsDir?: string,
  options: { weights?: WeightChoice } = {},
): (baseId: string, kernels: Kernels) => Promise<Model> {
  const resident = new WeakMap<Kernels, { id: string; model: Promise<Model> }>();
  const shipped = new Set(listCatalog().map((e) => e.id));
  return async (baseId, kernels) => {
    const current = resident.get(kernels);
    if (current?.id === baseId) return current.model;
    if (current) {
      resident.delete(kernels);
      const previous = await current.model.catch(() => null);
      if (previous) releaseModel(previous);
    }
    const dir = shipped.has(baseId)
      ? catalogModelDir(baseId)
      : modelsDir && /^[^/]+\/[^/]+$/.test(baseId) && !baseId.includes("..")
        ? join(modelsDir, baseId)
        : undefined;
    if (!dir) throw new Error(`no base model ${baseId}`);
    const model = loadModel(dir, { kernels, weights: options.weights ?? "f32" });
    const entry = { id: baseId, model };
    resident.set(kernels, entry);
    model.catch(() => {
      if (resident.get(kernels) === entry) resident.delete(kernels);
    });
    return model;
  };
}
