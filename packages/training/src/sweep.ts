import type { Store } from "@arbor/store";
import { CHECKPOINTS_PREFIX } from "./checkpoints.ts";
import { DATASETS_PREFIX } from "./datasets/datasets.ts";
import { PAYLOADS_PREFIX } from "./jobs.ts";
import { dropSuperseded, RUNS_PREFIX } from "./runs/execute.ts";

/** Blobs with no row naming them, from writes that a crash (or a kill) cut off. */
export interface SweepResult {
  /** Partial files of writers that are gone. */
  partial: string[];
  /** Checkpoint folders no checkpoint row names. */
  checkpoints: string[];
  /** Dataset files no dataset row names. */
  datasets: string[];
  /** RL job inputs no job names. */
  payloads: string[];
  /** Native runs' learner blobs nothing names: superseded states and gradients a crash left,
   * and the states of expired saved states. */
  runs: string[];
}

export interface SweepOptions {
  /** Only this model's checkpoint folders (after one of its jobs ended). */
  modelId?: string;
  /** A file with no row is left alone while younger than this (its row may be on its way).
   * Default 15 minutes. */
  graceMs?: number;
  /** A checkpoint folder of a model with no running job is left alone while younger than this:
   * an adapter upload, on any replica sharing the blobs, writes its files before its row.
   * Default 1 minute. */
  uploadGraceMs?: number;
  now?: () => number;
}

/**
 * Removes what interrupted writes left: partial files, and files whose row was never written.
 * A checkpoint folder is removed at once when its model is gone, else once older than the grace
 * while the model has a running job, or than the upload grace (a minute) while it has none; dataset files and RL
 * inputs once older than the grace, since their rows follow their writes within a request.
 * Native runs' learner states and gradients nothing names (superseded ones a crash left before
 * their delete, those of expired saved states) go once older than the grace too.
 */
export async function sweepBlobs(store: Store, options: SweepOptions = {}): Promise<SweepResult> {
  const result: SweepResult = {
    partial: [],
    checkpoints: [],
    datasets: [],
    payloads: [],
    runs: [],
  };
  const blobs = store.blobs;
  const now = options.now ?? Date.now;
  const grace = options.graceMs ?? 15 * 60_000;
  const uploadGrace = options.uploadGraceMs ?? 60_000;
  const old = async (key: string, ms = grace) =>
    now() - ((await blobs.info(key))?.modifiedAt ?? now()) > ms;
  if (!options.modelId) result.partial = await blobs.sweepPartial();

  const folders = new Map<string, { model: string; file: string }>();
  for (const key of await blobs.list(
    `${CHECKPOINTS_PREFIX}${options.modelId ? `${options.modelId}/` : ""}`,
  )) {
    const [, model, folder] = key.split("/");
    if (model && folder)
      folders.set(`${CHECKPOINTS_PREFIX}${model}/${folder}/`, { model, file: key });
  }
  const prefixes = [...folders.keys()];
  const models = [...new Set([...folders.values()].map((f) => f.model))];
  const referenced = await store.models.referencedBlobKeys(prefixes);
  const existing = await store.models.existingIds(models);
  const running = await store.jobs.runningAmong(models);
  for (const [prefix, { model, file }] of folders) {
    if (referenced.has(prefix)) continue;
    // A model that exists may be having a folder written: by its running job, or by an adapter
    // upload on another replica (files first, then the row), which no local check can see.
    if (existing.has(model) && !(await old(file, running.has(model) ? grace : uploadGrace)))
      continue;
    await blobs.deletePrefix(prefix);
    result.checkpoints.push(prefix);
  }
  if (options.modelId) return result;

  const datasets = await blobs.list(DATASETS_PREFIX);
  const named = await store.datasets.referencedBlobKeys(datasets);
  for (const key of datasets) {
    if (named.has(key) || !(await old(key))) continue;
    await blobs.delete(key);
    result.datasets.push(key);
  }
  const payloads = await blobs.list(PAYLOADS_PREFIX);
  const inputs = await store.jobs.referencedPayloads(payloads);
  for (const key of payloads) {
    if (inputs.has(key) || !(await old(key))) continue;
    await blobs.delete(key);
    result.payloads.push(key);
  }
  // A learner state is a folder (`training-runs/<run>/<folder>/`), a gradient a file; one is
  // written before the outcome naming it commits, so a young one is left alone.
  const learner = new Map<string, string>();
  for (const key of await blobs.list(RUNS_PREFIX)) {
    const [, run, name, file] = key.split("/");
    if (run && name) learner.set(file ? `${RUNS_PREFIX}${run}/${name}/` : key, key);
  }
  const live = await store.trainingRuns.referencedLearnerKeys([...learner.keys()]);
  const stale: string[] = [];
  for (const [candidate, key] of learner)
    if (!live.has(candidate) && (await old(key))) stale.push(candidate);
  result.runs = await dropSuperseded(store, stale);
  return result;
}
