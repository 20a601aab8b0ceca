/**
 * Training jobs as the domain has them: what a job asks for (typed from the spec's request
 * schemas, stored with the job's row), how it is enqueued, and how its stored spec becomes the
 * engine's configuration. The server enqueues through here; the runner reads through here.
 */
import type { LoraConfig, RlConfig, SftConfig } from "@arbor/engine";
import type { components } from "@arbor/spec/schema";
import {
  InvalidInputError,
  type Model,
  quote,
  type Store,
  type TrainingJob,
  uuidv7,
} from "@arbor/store";
import { datasetIdOf, findDataset } from "./datasets/datasets.ts";

type Schemas = components["schemas"];

/** What an SFT job asks for, as stored with its row: the request's two configs. */
export type SftJobSpec = {
  config: Schemas["SftConfig"];
  experimental_config: Schemas["SftExperimentalConfig"];
};

/** What an RL job asks for, as stored with its row: the request's experimental config. */
export type RlJobSpec = Schemas["RlExperimentalConfig"];

/** The most examples one SFT job may train on, counted once per epoch. */
export const MAX_JOB_EXAMPLES = 10_000_000;
/** The most optimizer steps one job may plan. */
export const MAX_JOB_STEPS = 1_000_000;
/** The most tokens one job may process, all epochs together. */
export const MAX_JOB_TOKENS = 5_000_000_000;

/** RL jobs' trajectory groups live in blobs under this prefix; the row points at one. */
export const PAYLOADS_PREFIX = "jobs/payloads/";

/**
 * Queues an SFT job for `model`. Data of ours (`dataset://`) is checked now, and the job's size
 * against the bounds as far as the dataset tells it; an `https://` URL is fetched by the worker.
 */
export async function enqueueSftJob(
  store: Store,
  model: Model,
  request: {
    training_data_url: string;
    config?: Schemas["SftConfig"] | null;
    experimental_config?: Schemas["SftExperimentalConfig"] | null;
  },
): Promise<TrainingJob> {
  const url = request.training_data_url;
  const config = request.config ?? {};
  if (url.startsWith("dataset://")) {
    // A `dataset://` URL that is not an id names no dataset: not found, like an unknown id.
    const dataset = await findDataset(store, model.entity, datasetIdOf(url) ?? url);
    checkSftSize(dataset.lines, config);
  } else if (!URL.canParse(url)) {
    throw new InvalidInputError(`training_data_url is not a valid URL: ${quote(url)}`, {
      param: "training_data_url",
      code: "invalid_training_data_url",
    });
  }
  const spec: SftJobSpec = { config, experimental_config: request.experimental_config ?? {} };
  return store.jobs.enqueue({
    type: "sft",
    model_id: model.id,
    entity: model.entity,
    config: spec,
    payload_ref: url,
    step_from: model.latest_step ?? 0,
  });
}

/** Queues one RL step on `groups` for `model`. The groups go to a blob first; the row points at
 * it, and the blob goes again if the row cannot be written. */
export async function enqueueRlJob(
  store: Store,
  model: Model,
  request: {
    trajectory_groups: Schemas["TrajectoryGroup"][];
    experimental_config?: RlJobSpec | null;
  },
): Promise<TrainingJob> {
  validateTrajectoryGroups(request.trajectory_groups);
  const blobs = store.blobs;
  if (!blobs) throw new Error("the store has no blob directory");
  const payload = `${PAYLOADS_PREFIX}${uuidv7()}.json`;
  await blobs.put(payload, JSON.stringify(request.trajectory_groups));
  try {
    return await store.jobs.enqueue({
      type: "rl",
      model_id: model.id,
      entity: model.entity,
      config: request.experimental_config ?? {},
      payload_ref: payload,
      step_from: model.latest_step ?? 0,
    });
  } catch (err) {
    await blobs.delete(payload).catch(() => undefined);
    throw err;
  }
}

/** Checks RL input before anything is stored: every trajectory has a turn to learn from and a
 * finite reward (CONTRACT §5). */
export function validateTrajectoryGroups(groups: readonly Schemas["TrajectoryGroup"][]): void {
  groups.forEach((group, g) => {
    group.trajectories.forEach((trajectory, t) => {
      const where = `trajectory_groups[${g}].trajectories[${t}]`;
      if (!Number.isFinite(trajectory.reward)) {
        throw new InvalidInputError(`${where}.reward must be a finite number.`, {
          param: `${where}.reward`,
          code: "invalid_trajectory",
        });
      }
      if (!trajectory.messages_and_choices.some(isChoice)) {
        throw new InvalidInputError(
          `${where} has no trainable turn: add the sampled choice ({index, message, finish_reason}) to messages_and_choices.`,
          { param: `${where}.messages_and_choices`, code: "invalid_trajectory" },
        );
      }
    });
  });
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

/** What a job's size is known to be at create: its examples and, with a fixed batch size, its
 * steps. The worker checks again against its plan (tokens too) before the first step. */
function checkSftSize(lines: number, config: Schemas["SftConfig"]): void {
  const epochs = config.epochs ?? DEFAULT_EPOCHS;
  if (lines * epochs > MAX_JOB_EXAMPLES) {
    throw new InvalidInputError(
      `The job would train on ${lines} lines × ${epochs} epochs, more than the limit of ${MAX_JOB_EXAMPLES} examples per job.`,
      { param: "config.epochs", code: "job_too_large" },
    );
  }
  const batch = config.batch_size;
  const rates = config.learning_rate;
  if (Array.isArray(rates) && typeof batch === "number") {
    const steps = Math.ceil(lines / batch) * epochs;
    if (rates.length !== steps) {
      throw new InvalidInputError(
        `config.learning_rate has ${rates.length} values for the job's ${steps} batches (${lines} lines in batches of ${batch}, ${epochs} ${epochs === 1 ? "pass" : "passes"}): give one value per batch, or one number.`,
        { param: "config.learning_rate", code: "invalid_learning_rate" },
      );
    }
  }
  if (typeof batch === "number" && Math.ceil(lines / batch) * epochs > MAX_JOB_STEPS) {
    throw new InvalidInputError(
      `The job would take ${Math.ceil(lines / batch) * epochs} steps, more than the limit of ${MAX_JOB_STEPS} per job.`,
      { param: "config.batch_size", code: "job_too_large" },
    );
  }
}

/** The spec a job was enqueued with. Its row was written by `enqueue*Job` from a request the
 * spec validated, so the stored JSON has the spec's shape. */
export function sftJobSpec(job: TrainingJob): SftJobSpec {
  const stored = job.config as Partial<SftJobSpec> | null;
  return { config: stored?.config ?? {}, experimental_config: stored?.experimental_config ?? {} };
}

export function rlJobSpec(job: TrainingJob): RlJobSpec {
  return (job.config as RlJobSpec | null) ?? {};
}

/** The engine's SFT configuration for a job on `baseModel`; absent or null fields keep the
 * engine's defaults. */
/** Passes over the data when a job does not say: one, as the hosted API defines a job (its
 * clients run their epochs themselves, one job per pass). */
export const DEFAULT_EPOCHS = 1;
/** Below this many base-model parameters, LoRA's default learning rate is `SMALL_MODEL_LR`. */
export const SMALL_MODEL_PARAMETERS = 100_000_000;
/** The default peak learning rate of LoRA on models of `SMALL_MODEL_PARAMETERS` or more. */
export const DEFAULT_LR = 2e-4;
/** On smaller models 2e-4 barely moves a LoRA adapter in a few hundred steps; this does. */
export const SMALL_MODEL_LR = 3e-3;

/**
 * The engine's configuration of an SFT job. Unset fields take the spec's defaults: a cosine
 * schedule, and a peak learning rate by the base model's size (`baseParameters`, when known).
 */
export function sftTrainingConfig(
  spec: SftJobSpec,
  baseModel: string,
  baseParameters?: number,
): SftConfig {
  const { config, experimental_config: x } = spec;
  const lora: LoraConfig = { baseModel };
  if (x.lora_rank != null) lora.rank = x.lora_rank;
  if (x.lora_alpha != null) lora.alpha = x.lora_alpha;
  const out: SftConfig = {
    seed: x.seed ?? 0,
    lora,
    epochs: config.epochs ?? DEFAULT_EPOCHS,
    batchSize: config.batch_size ?? "auto",
    assistantTurns: config.assistant_turns ?? "all",
    schedule: config.lr_schedule ?? "cosine",
    warmupSteps: config.warmup_steps ?? 0,
  };
  if (config.learning_rate != null) out.learningRate = config.learning_rate;
  else if (baseParameters !== undefined)
    out.learningRate = baseParameters < SMALL_MODEL_PARAMETERS ? SMALL_MODEL_LR : DEFAULT_LR;
  if (x.max_seq_len != null) out.maxLength = x.max_seq_len;
  if (x.max_grad_norm != null) out.maxGradNorm = x.max_grad_norm;
  if (x.weight_decay != null) out.adamW = { weightDecay: x.weight_decay };
  return out;
}

/** The engine's configuration of one RL step, with the learning rate and seed apart. */
export function rlStepConfig(spec: RlJobSpec): {
  config: RlConfig;
  learningRate: number;
  maxGradNorm: number;
  seed: number;
} {
  const config: RlConfig = {};
  if (spec.loss_fn != null) config.lossFn = spec.loss_fn;
  if (spec.epsilon != null) config.epsilon = spec.epsilon;
  if (spec.epsilon_high != null) config.epsilonHigh = spec.epsilon_high;
  if (spec.scale_rewards != null) config.scaleRewards = spec.scale_rewards;
  if (spec.normalize_advantages != null) config.normalizeAdvantages = spec.normalize_advantages;
  return {
    config,
    learningRate: spec.learning_rate ?? 1e-5,
    maxGradNorm: spec.max_grad_norm ?? 1,
    seed: spec.seed ?? 0,
  };
}
