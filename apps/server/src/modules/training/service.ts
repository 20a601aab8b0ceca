import type { components } from "@arbor/spec/schema";
import type { JobEvent, Store, TrainingJob } from "@arbor/store";
import { uuidv7 } from "@arbor/store";
import { datasetIdOf, MAX_JOB_EXAMPLES, MAX_JOB_STEPS, PAYLOADS_PREFIX } from "@arbor/training";
import { ApiError, quote } from "../../http/errors.ts";
import type { Principal } from "../../http/principal.ts";
import { findModel } from "../models/service.ts";

type Schemas = components["schemas"];

export const TERMINAL_EVENT_TYPES = new Set(["training_ended", "training_failed"]);

export function jobToWire(job: TrainingJob): Schemas["TrainingJob"] {
  return {
    id: job.id,
    object: "training_job",
    type: job.type,
    model_id: job.model_id,
    status: job.status,
    created_at: job.created_at,
    training_start: job.training_start,
    training_end: job.training_end,
    error_message: job.error_message,
    step_from: job.step_from ?? 0,
    step_to: job.step_to,
  };
}

export function eventToWire(event: JobEvent): Schemas["TrainingJobEvent"] {
  return {
    id: event.id,
    object: "training_job.event",
    type: event.type as Schemas["TrainingJobEvent"]["type"],
    data: (event.data ?? {}) as Record<string, unknown>,
    created_at: event.created_at,
  };
}

/** A job of an entity the principal may use; any other reads as missing. */
export async function findJob(
  store: Store,
  principal: Principal,
  jobId: string,
): Promise<TrainingJob> {
  for (const entity of principal.entities) {
    const job = await store.jobs.get(entity, jobId);
    if (job) return job;
  }
  throw ApiError.notFound(`Training job ${quote(jobId)} not found.`, "training_job_not_found");
}

/** An item of `messages_and_choices` that is a sampled assistant turn (an OpenAI choice). */
function isChoice(item: unknown): boolean {
  return (
    typeof item === "object" &&
    item !== null &&
    "message" in item &&
    "finish_reason" in item &&
    "index" in item
  );
}

/** Checks RL input before anything is stored: every trajectory must have a turn to learn from
 * and a finite reward (CONTRACT §5). */
export function validateTrajectoryGroups(groups: Schemas["TrajectoryGroup"][]): void {
  groups.forEach((group, g) => {
    group.trajectories.forEach((trajectory, t) => {
      const where = `trajectory_groups[${g}].trajectories[${t}]`;
      if (typeof trajectory.reward !== "number" || !Number.isFinite(trajectory.reward)) {
        throw ApiError.badRequest(
          `${where}.reward must be a finite number.`,
          `${where}.reward`,
          "invalid_trajectory",
        );
      }
      if (!trajectory.messages_and_choices.some(isChoice)) {
        throw ApiError.badRequest(
          `${where} has no trainable turn: add the sampled choice ({index, message, finish_reason}) to messages_and_choices.`,
          `${where}.messages_and_choices`,
          "invalid_trajectory",
        );
      }
    });
  });
}

/** RL: one step on the groups, stored as a blob first (the row only points at it). */
export async function createRlJob(
  store: Store,
  principal: Principal,
  body: Schemas["CreateRlTrainingJobRequest"],
) {
  const model = await findModel(store, principal, body.model_id);
  validateTrajectoryGroups(body.trajectory_groups);
  const blobs = requireBlobs(store);
  const payload = `${PAYLOADS_PREFIX}${uuidv7()}.json`;
  await blobs.put(payload, Buffer.from(JSON.stringify(body.trajectory_groups)));
  try {
    const job = await store.jobs.enqueue({
      type: "rl",
      model_id: model.id,
      entity: model.entity,
      config: (body.experimental_config ?? {}) as never,
      payload_ref: payload,
      step_from: model.latest_step ?? 0,
    });
    return jobToWire(job);
  } catch (err) {
    await blobs.delete(payload).catch(() => undefined);
    throw err;
  }
}

/** SFT: the data is checked now when it is ours (`dataset://`), fetched by the worker when it
 * is an `https://` URL. */
export async function createSftJob(
  store: Store,
  principal: Principal,
  body: Schemas["CreateSftTrainingJobRequest"],
) {
  const model = await findModel(store, principal, body.model_id);
  const url = body.training_data_url;
  if (url.startsWith("dataset://")) {
    const id = datasetIdOf(url);
    const dataset = id ? await store.datasets.get(model.entity, id) : undefined;
    if (!dataset) throw ApiError.notFound(`Dataset ${quote(url)} not found.`, "dataset_not_found");
    checkJobSize(dataset.lines, body.config ?? {});
  } else if (!URL.canParse(url)) {
    throw ApiError.badRequest(
      `training_data_url is not a valid URL: ${quote(url)}`,
      "training_data_url",
    );
  }
  const job = await store.jobs.enqueue({
    type: "sft",
    model_id: model.id,
    entity: model.entity,
    config: {
      config: body.config ?? {},
      experimental_config: body.experimental_config ?? {},
    } as never,
    payload_ref: url,
    step_from: model.latest_step ?? 0,
  });
  return jobToWire(job);
}

/** What a job's size is known to be at create: its examples and, with a fixed batch size, its
 * steps. The worker checks again against its plan (tokens too) before the first step. */
function checkJobSize(lines: number, config: Schemas["SftConfig"]): void {
  const epochs = config.epochs ?? 1;
  if (lines * epochs > MAX_JOB_EXAMPLES) {
    throw ApiError.badRequest(
      `The job would train on ${lines} lines × ${epochs} epochs, more than the limit of ${MAX_JOB_EXAMPLES} examples per job.`,
      "config.epochs",
      "job_too_large",
    );
  }
  const batch = config.batch_size;
  if (typeof batch === "number" && Math.ceil(lines / batch) * epochs > MAX_JOB_STEPS) {
    throw ApiError.badRequest(
      `The job would take ${Math.ceil(lines / batch) * epochs} steps, more than the limit of ${MAX_JOB_STEPS} per job.`,
      "config.batch_size",
      "job_too_large",
    );
  }
}

function requireBlobs(store: Store) {
  if (!store.blobs) throw new Error("the store has no blob directory");
  return store.blobs;
}
