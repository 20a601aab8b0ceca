import type { components } from "@arbor/spec/schema";
import type { Checkpoint, Model, Store } from "@arbor/store";
import { ConflictError, InvalidInputError, NotFoundError, quote } from "@arbor/store";
import { modelFilesPrefix, withModelFiles } from "@arbor/training";
import { findOwned, type Principal, requireEntity } from "../access.ts";

type Schemas = components["schemas"];

/** `<entity>/<project>/<name>`: the chat id of a model's latest checkpoint. */
export function chatIdOf(model: Pick<Model, "entity" | "project" | "name">): string {
  return `${model.entity}/${model.project}/${model.name}`;
}

export function modelToWire(model: Model): Schemas["Model"] {
  return {
    id: model.id,
    object: "model",
    entity: model.entity,
    project: model.project,
    name: model.name,
    base_model: model.base_model,
    run_id: null,
    created_at: model.created_at,
    latest_step: model.latest_step ?? 0,
  };
}

export function checkpointToWire(model: Model, checkpoint: Checkpoint): Schemas["Checkpoint"] {
  return {
    id: checkpoint.id,
    object: "checkpoint",
    step: checkpoint.step,
    metrics: finiteMetrics(checkpoint.metrics),
    created_at: checkpoint.created_at,
    model: `${chatIdOf(model)}:step${checkpoint.step}`,
  };
}

/** A model of an entity the principal may use; any other reads as missing (404). */
export async function findModel(
  store: Store,
  principal: Principal,
  modelId: string,
): Promise<Model> {
  const model = await findOwned(principal, (entity) => store.models.get(entity, modelId));
  if (model) return model;
  throw new NotFoundError(`Model ${quote(modelId)} not found.`, { code: "model_not_found" });
}

export interface CreateModelDeps {
  store: Store;
  /** The base models training can start from. */
  baseModels: () => Promise<string[]>;
}

/** `createModel`: create with `return_existing`, 409 on a duplicate, 400 on an unknown base; the
 * step-0 checkpoint (the identity adapter: the base model itself) is written with the row. */
export async function createModel(
  deps: CreateModelDeps,
  principal: Principal,
  body: Schemas["CreateModelRequest"],
) {
  const entity = body.entity ?? principal.defaultEntity;
  requireEntity(principal, entity);
  const supported = await deps.baseModels();
  if (!supported.includes(body.base_model)) {
    throw new InvalidInputError(
      `Unsupported base_model ${quote(body.base_model)}. Supported: ${supported.join(", ")}.`,
      { param: "base_model", code: "unsupported_base_model" },
    );
  }
  try {
    const { model } = await deps.store.models.create(
      {
        entity,
        project: body.project,
        name: body.name,
        base_model: body.base_model,
        initialCheckpoint: { step: 0, blob_key: null },
      },
      { returnExisting: body.return_existing ?? false },
    );
    return modelToWire(model);
  } catch (err) {
    if (err instanceof ConflictError) {
      throw new ConflictError(
        `Model ${entity}/${body.project}/${body.name} already exists; send return_existing: true to get it.`,
        { code: "model_exists" },
      );
    }
    throw err;
  }
}

/** Deletes a model with its checkpoints and files. A job still queued or running for it is
 * cancelled first (its terminal event is written); then the rows go, then the files: a crash in
 * between leaves unnamed files (swept later), never a row that points at nothing. */
export async function deleteModel(
  store: Store,
  principal: Principal,
  modelId: string,
  deleted: CheckpointsDeleted = noHook,
) {
  const model = await findModel(store, principal, modelId);
  for (const status of ["running", "queued"] as const) {
    const { data } = await store.jobs.list(model.entity, {
      model_id: model.id,
      status,
      limit: 100,
    });
    for (const job of data) await store.jobs.cancelJob(model.entity, job.id).catch(() => undefined);
  }
  // Uploads and exports writing the model's files finish first; later ones find it gone.
  const removed = await withModelFiles(model.id, "delete", async () => {
    const removed = await store.models.delete(model.entity, model.id);
    // Everything under the model's prefix goes, files no row named included.
    await store.blobs.deletePrefix(modelFilesPrefix(model.id));
    return removed;
  });
  await deleteBlobs(store, removed.payload_keys);
  await deleted(model, removed.blob_keys);
  return {
    model_id: model.id,
    deleted_checkpoints: removed.deleted_checkpoints,
    deleted_run: false as const,
  };
}

/** Deletes checkpoints by step; the latest one, which the model serves, cannot go (409). */
export async function deleteCheckpoints(
  store: Store,
  principal: Principal,
  modelId: string,
  steps: number[],
  deleted: CheckpointsDeleted = noHook,
) {
  const model = await findModel(store, principal, modelId);
  const result = await withModelFiles(model.id, "delete", async () => {
    const result = await store.models
      .deleteCheckpoints(model.entity, model.id, steps)
      .catch((err: unknown) => {
        if (err instanceof ConflictError) {
          throw new ConflictError(`${err.message}: it is what ${chatIdOf(model)} serves.`, {
            code: "latest_checkpoint",
          });
        }
        throw err;
      });
    await deleteBlobs(store, result.blob_keys);
    return result;
  });
  await deleted(model, result.blob_keys);
  return { deleted_count: result.deleted_count, not_found_steps: result.not_found_steps };
}

/** Told of a model's checkpoints deleted, by their files' keys, once rows and files are gone
 * (upstreams serving them unload them). It never throws. */
export type CheckpointsDeleted = (model: Model, blobKeys: string[]) => Promise<void>;

const noHook: CheckpointsDeleted = async () => {};

/** Files go after their rows. */
async function deleteBlobs(store: Store, keys: string[]): Promise<void> {
  for (const key of keys) await store.blobs.deletePrefix(key);
}

/** `logModelMetrics`: a split's metrics, stored on the model's latest checkpoint (ADR 4). */
export async function logMetrics(
  store: Store,
  principal: Principal,
  modelId: string,
  body: Schemas["LogModelMetricsRequest"],
) {
  const model = await findModel(store, principal, modelId);
  const metrics = splitMetrics(body.split, body.trajectory_groups);
  const step = model.latest_step ?? 0;
  await store.models.mergeCheckpointMetrics(model.entity, model.id, step, metrics);
  return { step, metrics };
}

/** The mean, and the mean within-group standard deviation, of the groups' rewards; the
 * exception rate; the mean of each trajectory metric (`logModelMetrics`). */
export function splitMetrics(
  split: string,
  groups: Schemas["TrajectoryGroup"][],
): Record<string, number> {
  const rewards: number[] = [];
  const stds: number[] = [];
  const sums = new Map<string, { total: number; count: number }>();
  let exceptions = 0;
  for (const group of groups) {
    const groupRewards = group.trajectories.map((t) => t.reward ?? 0);
    rewards.push(...groupRewards);
    // A group whose rollouts all failed has no rewards, only exceptions.
    if (groupRewards.length > 0) stds.push(std(groupRewards));
    exceptions += Array.isArray(group.exceptions) ? group.exceptions.length : 0;
    for (const trajectory of group.trajectories) {
      for (const [name, value] of Object.entries(trajectory.metrics ?? {})) {
        const v = typeof value === "boolean" ? Number(value) : value;
        if (typeof v !== "number" || !Number.isFinite(v)) continue;
        const s = sums.get(name) ?? { total: 0, count: 0 };
        s.total += v;
        s.count += 1;
        sums.set(name, s);
      }
    }
  }
  const metrics: Record<string, number> = {
    [`${split}/reward`]: mean(rewards),
    [`${split}/reward_std_dev`]: mean(stds),
    [`${split}/exception_rate`]: exceptions / (rewards.length + exceptions || 1),
  };
  for (const [name, { total, count }] of sums) metrics[`${split}/${name}`] = total / count;
  // Finite inputs can still overflow a sum (two rewards of 1e308): refuse before storing.
  for (const [name, value] of Object.entries(metrics)) {
    if (!Number.isFinite(value)) {
      throw new InvalidInputError(
        `The metric ${name} overflows (${value}): send rewards and metrics of a smaller magnitude.`,
        { param: "trajectory_groups", code: "metric_overflow" },
      );
    }
  }
  return metrics;
}

/** Stored metrics as the wire allows them: numbers only. A value that is not a finite number
 * (written before this check existed) is left out rather than failing every later read. */
function finiteMetrics(metrics: Record<string, unknown>): Record<string, number> {
  const out: Record<string, number> = {};
  for (const [name, value] of Object.entries(metrics)) {
    if (typeof value === "number" && Number.isFinite(value)) out[name] = value;
  }
  return out;
}

function mean(values: number[]): number {
  return values.length === 0 ? 0 : values.reduce((a, b) => a + b, 0) / values.length;
}

function std(values: number[]): number {
  const m = mean(values);
  return Math.sqrt(mean(values.map((v) => (v - m) ** 2)));
}
