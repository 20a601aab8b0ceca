/**
 * Training jobs as the domain has them: what a job asks for (typed from the spec's request
 * schemas, stored with the job's row), how it is enqueued, and how its stored spec becomes the
 * engine's configuration. The server enqueues through here; the runner reads through here.
 */
import { HEAD_TARGET, LORA_TARGETS, type LoraConfig } from "@arbor/engine/model";
import type { DpoConfig, RlConfig, SftConfig } from "@arbor/engine/train";
import type { components } from "@arbor/spec/schema";
import {
  InvalidInputError,
  type Model,
  quote,
  type Store,
  type TrainingJob,
  uuidv7,
} from "@arbor/store";
import { datasetIdOf, datasetKind, findDataset } from "./datasets/datasets.ts";

type Schemas = components["schemas"];

/** What an SFT job asks for, as stored with its row: the request's two configs, and its
 * validation set when it has one (the training set's URL is the row's `payload_ref`). */
export type SftJobSpec = {
  config: Schemas["SftConfig"];
  experimental_config: Schemas["SftExperimentalConfig"];
  validation_data_url?: string;
};

/** What an RL job asks for, as stored with its row: the request's experimental config. */
export type RlJobSpec = Schemas["RlExperimentalConfig"];

/** The most examples one SFT job may train on, counted once per epoch. */
export const MAX_JOB_EXAMPLES = 10_000_000;
/** The most optimizer steps one job may plan. */
export const MAX_JOB_STEPS = 1_000_000;
/** The most tokens one job may process, all epochs together. */
export const MAX_JOB_TOKENS = 5_000_000_000;

/** The most examples (lines) a job's validation set may hold. */
export const MAX_VALIDATION_EXAMPLES = 100_000;
/** The most tokens a job's validation set may hold (once; each evaluation reads them all). */
export const MAX_VALIDATION_TOKENS = 10_000_000;

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
    validation_data_url?: string | null;
    config?: Schemas["SftConfig"] | null;
    experimental_config?: Schemas["SftExperimentalConfig"] | null;
  },
): Promise<TrainingJob> {
  const url = request.training_data_url;
  const config = request.config ?? {};
  const method = config.method ?? "sft";
  if (config.dpo_beta != null && method !== "dpo") {
    throw new InvalidInputError(
      'config.dpo_beta is DPO\'s: set config.method to "dpo" to train on preference pairs, or leave dpo_beta out.',
      { param: "config.dpo_beta", code: "invalid_config" },
    );
  }
  const lines = await checkDataUrl(store, model.entity, url, "training_data_url");
  if (lines !== undefined) checkSftSize(lines, config);
  if (url.startsWith("dataset://")) {
    // A dataset holds one kind, its first line's (ADR 69): a method of the other is refused now.
    const dataset = await findDataset(store, model.entity, datasetIdOf(url) ?? url);
    const kind = await datasetKind(store, dataset);
    if (kind !== method) {
      throw new InvalidInputError(
        kind === "dpo"
          ? `Dataset ${quote(dataset.id)} holds DPO preference pairs: set config.method to "dpo" to train on them.`
          : `Dataset ${quote(dataset.id)} holds SFT examples ({messages}), and config.method "dpo" trains on preference pairs ({input, preferred_output, non_preferred_output}).`,
        { param: "config.method", code: "dataset_method_mismatch" },
      );
    }
  }
  const validation = request.validation_data_url ?? undefined;
  if (validation !== undefined) {
    if (method === "dpo") {
      throw new InvalidInputError(
        "validation_data_url scores SFT examples ({messages}); a DPO job takes no validation set yet.",
        { param: "validation_data_url", code: "unsupported_validation_data_url" },
      );
    }
    const count = await checkDataUrl(store, model.entity, validation, "validation_data_url");
    if (count !== undefined && count > MAX_VALIDATION_EXAMPLES) {
      throw new InvalidInputError(
        `The validation set has ${count} lines, more than the limit of ${MAX_VALIDATION_EXAMPLES}: validate on a sample of it.`,
        { param: "validation_data_url", code: "validation_set_too_large" },
      );
    }
    if (validation.startsWith("dataset://")) {
      const dataset = await findDataset(store, model.entity, datasetIdOf(validation) ?? validation);
      if ((await datasetKind(store, dataset)) !== "sft") {
        throw new InvalidInputError(
          `Dataset ${quote(dataset.id)} holds DPO preference pairs; a validation set holds SFT examples ({messages}).`,
          { param: "validation_data_url", code: "dataset_method_mismatch" },
        );
      }
    }
  }
  const spec: SftJobSpec = {
    config,
    experimental_config: request.experimental_config ?? {},
    ...(validation !== undefined ? { validation_data_url: validation } : {}),
  };
  return store.jobs.enqueue({
    type: "sft",
    model_id: model.id,
    entity: model.entity,
    config: spec,
    payload_ref: url,
    step_from: model.latest_step ?? 0,
  });
}

/**
 * Checks a data URL of an SFT job (`training_data_url` or `validation_data_url`, `param`): a
 * `dataset://` must name one of the entity's datasets (its lines are returned), an `https://`
 * URL must parse (the worker fetches it), and a `wandb-artifact://` is refused.
 */
async function checkDataUrl(
  store: Store,
  entity: string,
  url: string,
  param: "training_data_url" | "validation_data_url",
): Promise<number | undefined> {
  if (url.startsWith("wandb-artifact://")) {
    throw new InvalidInputError(
      `${param} ${quote(url)} is a W&B artifact (where ART's train_sft uploads its data), which a self-hosted Arbor cannot read: upload the JSONL with POST /v1/preview/datasets (or arbor datasets upload) and send its dataset:// URL.`,
      { param, code: `unsupported_${param}` },
    );
  }
  if (url.startsWith("dataset://")) {
    // A `dataset://` URL that is not an id names no dataset: not found, like an unknown id.
    return (await findDataset(store, entity, datasetIdOf(url) ?? url)).lines;
  }
  if (!URL.canParse(url)) {
    throw new InvalidInputError(`${param} is not a valid URL: ${quote(url)}`, {
      param,
      code: `invalid_${param}`,
    });
  }
  return undefined;
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
  validateTrajectoryGroups(request.trajectory_groups, request.experimental_config ?? {});
  checkRlSpec(request.experimental_config ?? {});
  const blobs = store.blobs;
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

/** Checks RL input before anything is stored: every trajectory has a turn it could learn from
 * (a choice, or with `allow_training_without_logprobs` an assistant message) and a finite
 * reward (absent is 0). */
export function validateTrajectoryGroups(
  groups: readonly Schemas["TrajectoryGroup"][],
  spec: RlJobSpec = {},
): void {
  const messagesTrain = spec.allow_training_without_logprobs === true;
  groups.forEach((group, g) => {
    group.trajectories.forEach((trajectory, t) => {
      const where = `trajectory_groups[${g}].trajectories[${t}]`;
      if (trajectory.reward !== undefined && !Number.isFinite(trajectory.reward)) {
        throw new InvalidInputError(`${where}.reward must be a finite number.`, {
          param: `${where}.reward`,
          code: "invalid_trajectory",
        });
      }
      const trainable = (item: unknown) => isChoice(item) || (messagesTrain && isAssistant(item));
      if (!trajectory.messages_and_choices.some(trainable)) {
        throw new InvalidInputError(
          `${where} has no trainable turn: add the sampled choice ({index, message, finish_reason}) to messages_and_choices.`,
          { param: `${where}.messages_and_choices`, code: "invalid_trajectory" },
        );
      }
    });
  });
}

/** An item of `messages_and_choices` that is a sampled assistant turn (an OpenAI choice): any
 * item without `role`, with a `message`. */
function isChoice(item: unknown): boolean {
  return typeof item === "object" && item !== null && !("role" in item) && "message" in item;
}

function isAssistant(item: unknown): boolean {
  return (
    typeof item === "object" && item !== null && (item as { role?: unknown }).role === "assistant"
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
  return {
    config: stored?.config ?? {},
    experimental_config: stored?.experimental_config ?? {},
    ...(stored?.validation_data_url ? { validation_data_url: stored.validation_data_url } : {}),
  };
}

/**
 * The job's steps after which its validation set is evaluated: 0 (before the first step), every
 * `eval_every` steps, and the last. Default `eval_every`: `checkpoint_every` when set, else a
 * tenth of the steps rounded up (about ten points).
 */
export function validationSteps(config: Schemas["SftConfig"], totalSteps: number): Set<number> {
  const every = config.eval_every ?? config.checkpoint_every ?? Math.ceil(totalSteps / 10);
  const steps = new Set([0, totalSteps]);
  for (let step = every; step < totalSteps; step += Math.max(1, every)) steps.add(step);
  return steps;
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
 * A fresh adapter's layout for a base: the seven linears of every layer, and on bases under
 * `SMALL_MODEL_PARAMETERS` the output head too. A small base's tied head cannot tell apart the
 * tokens its pretraining never used (their embedding rows collapse together), so LoRA on the
 * linears alone cannot make it emit a new format with confidence; an adapted head can, and
 * costs vocab × r parameters. Larger bases train their tokens and keep PEFT's usual targets.
 */
export function defaultLora(baseModel: string, baseParameters?: number): LoraConfig {
  const small = baseParameters !== undefined && baseParameters < SMALL_MODEL_PARAMETERS;
  return { baseModel, ...(small ? { head: true } : {}) };
}

/** The peak LoRA learning rate an SFT job takes by default on a base of this many parameters. */
export function defaultLearningRate(baseParameters: number): number {
  return baseParameters < SMALL_MODEL_PARAMETERS ? SMALL_MODEL_LR : DEFAULT_LR;
}

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
  const lora = defaultLora(baseModel, baseParameters);
  if (x.lora_target_modules != null) {
    lora.targetModules = LORA_TARGETS.filter((t) => x.lora_target_modules!.includes(t));
    lora.head = x.lora_target_modules.includes(HEAD_TARGET);
  }
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
  else if (baseParameters !== undefined) out.learningRate = defaultLearningRate(baseParameters);
  if (x.max_seq_len != null) out.maxLength = x.max_seq_len;
  if (x.max_grad_norm != null) out.maxGradNorm = x.max_grad_norm;
  if (x.weight_decay != null) out.adamW = { weightDecay: x.weight_decay };
  return out;
}

/** The engine's configuration of a DPO job (`config.method: dpo`, ADR 69): SFT's, and β. */
export function dpoTrainingConfig(
  spec: SftJobSpec,
  baseModel: string,
  baseParameters?: number,
): DpoConfig {
  const { assistantTurns: _, ...config } = sftTrainingConfig(spec, baseModel, baseParameters);
  return { ...config, beta: spec.config.dpo_beta ?? 0.1 };
}

/** The engine's configuration of one RL step, with the learning rate and seed apart, and the
 * checkpoint step of the KL reference (null: the base model) when the penalty is on. */
export function rlStepConfig(
  spec: RlJobSpec,
  stepFrom: number,
): {
  config: RlConfig;
  learningRate: number;
  maxGradNorm: number;
  seed: number;
  klReferenceStep: number | null;
} {
  const config: RlConfig = { lossFn: rlLoss(spec) };
  if (spec.epsilon != null) config.epsilon = spec.epsilon;
  if (spec.epsilon_high != null) config.epsilonHigh = spec.epsilon_high;
  // ART's two names of one switch: either false turns the division by the std off.
  config.scaleRewards = (spec.scale_rewards ?? true) && (spec.normalize_advantages ?? true);
  if (spec.advantage_balance != null) config.advantageBalance = spec.advantage_balance;
  if (spec.importance_sampling_level != null)
    config.importanceSamplingLevel = spec.importance_sampling_level;
  const cap = spec.max_negative_advantage_importance_sampling_weight;
  if (cap != null) config.maxImportanceWeight = cap;
  if (spec.mask_prob_ratio != null) config.maskProbRatio = spec.mask_prob_ratio;
  if (spec.kimi_k2_tau != null) config.kimiK2Tau = spec.kimi_k2_tau;
  if (spec.truncated_importance_sampling != null)
    config.truncatedImportanceSampling = spec.truncated_importance_sampling;
  if (spec.precalculate_logprobs != null) config.precalculateLogprobs = spec.precalculate_logprobs;
  if (spec.allow_training_without_logprobs != null)
    config.allowTrainingWithoutLogprobs = spec.allow_training_without_logprobs;
  if (spec.packed_sequence_length != null) config.maxSequenceLength = spec.packed_sequence_length;
  let klReferenceStep: number | null = null;
  if (spec.kl_penalty_coef) {
    config.klPenaltyCoef = spec.kl_penalty_coef;
    if (spec.kl_penalty_source != null) config.klPenaltySource = spec.kl_penalty_source;
    if (spec.kl_penalty_reference_step != null) klReferenceStep = spec.kl_penalty_reference_step;
    else if (spec.kl_penalty_step_lag != null)
      klReferenceStep = Math.max(0, stepFrom - spec.kl_penalty_step_lag);
  }
  return {
    config,
    learningRate: spec.learning_rate ?? 1e-5,
    maxGradNorm: spec.max_grad_norm ?? 1,
    seed: spec.seed ?? 0,
    klReferenceStep: klReferenceStep === 0 ? null : klReferenceStep,
  };
}

/** `loss_fn`, else ART's `ppo` switch (false is `cispo`), else `cispo`. */
function rlLoss(spec: RlJobSpec): NonNullable<RlConfig["lossFn"]> {
  if (spec.loss_fn != null) return spec.loss_fn;
  return spec.ppo ? "ppo" : "cispo";
}

/** What an RL job's settings cannot mean, refused before anything is stored. */
export function checkRlSpec(spec: RlJobSpec): void {
  const refuse = (param: string, message: string) => {
    throw new InvalidInputError(message, {
      param: `experimental_config.${param}`,
      code: "invalid_experimental_config",
    });
  };
  if (spec.ppo != null && spec.loss_fn != null && spec.ppo !== (spec.loss_fn === "ppo")) {
    refuse(
      "ppo",
      `experimental_config.ppo is ${spec.ppo} but loss_fn is ${quote(spec.loss_fn)}: set one of them, or make them agree.`,
    );
  }
  if (spec.kl_ref_adapter_path != null) {
    refuse(
      "kl_ref_adapter_path",
      "experimental_config.kl_ref_adapter_path names a file on the client's machine, which the server cannot read: upload the adapter as a checkpoint of the model and name its step in kl_penalty_reference_step.",
    );
  }
  if (spec.kl_penalty_reference_step != null && spec.kl_penalty_step_lag != null) {
    refuse(
      "kl_penalty_step_lag",
      "experimental_config sets both kl_penalty_reference_step and kl_penalty_step_lag: the KL reference is one checkpoint, so set one.",
    );
  }
}
