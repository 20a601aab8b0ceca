import { catalogModelDir, loadModel, type Model, type SftExample } from "@arbor/engine";
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

/** The shipped base models, each loaded once. */
export function catalogModels(): (baseId: string) => Promise<Model> {
  const loaded = new Map<string, Promise<Model>>();
  return (baseId) => {
    let model = loaded.get(baseId);
    if (!model) {
      model = loadModel(catalogModelDir(baseId));
      loaded.set(baseId, model);
    }
    return model;
  };
}
