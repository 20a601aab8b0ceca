import type { components } from "@arbor/spec/schema";
import type {
  Checkpoint,
  Dataset,
  FineTuningJob,
  JobEvent,
  JobProgress,
  Store,
  TrainingJob,
} from "@arbor/store";
import { NotFoundError, quote } from "@arbor/store";
import { findOwned, type Principal } from "../access.ts";

type Schemas = components["schemas"];

/**
 * OpenAI's ids over Arbor's uuids (ADR 70): a prefix and the uuid's 32 hex digits, so each id
 * reads back to the row it names without a table of its own.
 */
const hex = (uuid: string) => uuid.replaceAll("-", "");
const uuidOf = (digits: string) =>
  `${digits.slice(0, 8)}-${digits.slice(8, 12)}-${digits.slice(12, 16)}-${digits.slice(16, 20)}-${digits.slice(20)}`;

function prefixed(prefix: string) {
  const pattern = new RegExp(`^${prefix}-([0-9a-f]{32})$`);
  return {
    of: (uuid: string) => `${prefix}-${hex(uuid)}`,
    /** The uuid an id names; undefined for anything else. */
    uuid: (id: string): string | undefined => {
      const match = pattern.exec(id);
      return match ? uuidOf(match[1]!) : undefined;
    },
  };
}

export const fileIds = prefixed("file");
export const jobIds = prefixed("ftjob");
export const eventIds = prefixed("ftevent");
export const checkpointIds = prefixed("ftckpt");

/** `ft:<base>:<entity>:<suffix>:<short id>`, OpenAI's form without a `/`: the base's name
 * without its owner (clients percent-encode a `/` in `/v1/models/{model}`). */
export function fineTunedModelName(
  baseModel: string,
  entity: string,
  suffix: string | null,
  jobUuid: string,
): string {
  const base = baseModel.slice(baseModel.lastIndexOf("/") + 1);
  return `ft:${base}:${entity}:${suffix ?? ""}:${hex(jobUuid).slice(-8)}`;
}

/** `<fine-tuned model>:ckpt-step-<N>`, as OpenAI names a job's checkpoints: N is the job's
 * step, counted from 1 in each job (the model's step less the job's `step_from`, which differ
 * when a job goes on training a fine-tuned model). */
export function checkpointName(fineTunedModel: string, step: number): string {
  return `${fineTunedModel}:ckpt-step-${step}`;
}

/** `ft:…` or `ft:…:ckpt-step-N` → the fine-tuned model's name and the step named, if any. */
export function parseFineTunedName(id: string): { name: string; step: number | null } | null {
  if (!id.startsWith("ft:")) return null;
  const match = /^(.*):ckpt-step-(\d{1,9})$/.exec(id);
  return match ? { name: match[1]!, step: Number(match[2]) } : { name: id, step: null };
}

export function fileToWire(dataset: Dataset): Schemas["OpenAIFile"] {
  return {
    id: fileIds.of(dataset.id),
    object: "file",
    bytes: dataset.bytes,
    created_at: dataset.created_at,
    filename: dataset.filename ?? `${dataset.name ?? dataset.id}.jsonl`,
    purpose: "fine-tune",
    status: "processed",
    status_details: null,
    expires_at: null,
  };
}

/** A file of one of the principal's entities, by its OpenAI id; anything else is 404. */
export async function findFile(store: Store, principal: Principal, fileId: string) {
  const uuid = fileIds.uuid(fileId);
  const dataset = uuid ? await findOwned(principal, (e) => store.datasets.get(e, uuid)) : undefined;
  if (dataset) return dataset;
  throw new NotFoundError(`No such file: ${quote(fileId)}.`, {
    code: "file_not_found",
    param: "file_id",
  });
}

/** A fine-tuning job of the principal's entities with its training job; anything else is 404. */
export async function findFineTuningJob(
  store: Store,
  principal: Principal,
  id: string,
): Promise<{ ft: FineTuningJob; job: TrainingJob }> {
  const ft = jobIds.uuid(id) ? await store.fineTuningJobs.get(principal.entities, id) : undefined;
  const job = ft ? await store.jobs.get(ft.entity, ft.job_id) : undefined;
  if (!ft || !job) {
    throw new NotFoundError(`No such fine-tuning job: ${quote(id)}.`, {
      code: "fine_tuning_job_not_found",
      param: "fine_tuning_job_id",
    });
  }
  return { ft, job };
}

type Status = Schemas["FineTuningJob"]["status"];

export function fineTuningStatus(job: TrainingJob): Status {
  if (job.status === "queued" && job.paused_at !== null) return "paused";
  return job.status;
}

/** The job in OpenAI's shape. `now` (Unix seconds) dates the estimate of a running job's end. */
export function fineTuningJobToWire(
  ft: FineTuningJob,
  job: TrainingJob,
  progress: JobProgress | null,
  now: number,
): Schemas["FineTuningJob"] {
  const status = fineTuningStatus(job);
  const method = ft.method as Schemas["FineTuningJob"]["method"];
  const hyperparameters = ft.hyperparameters as Schemas["FineTuningJob"]["hyperparameters"];
  const ended = status === "succeeded" || status === "failed" || status === "cancelled";
  let estimated: number | null = null;
  if (status === "running" && progress?.total_steps && progress.step > 0 && job.training_start) {
    const elapsed = Math.max(0, now - job.training_start);
    estimated = Math.round(job.training_start + (elapsed * progress.total_steps) / progress.step);
  }
  return {
    id: jobIds.of(job.id),
    object: "fine_tuning.job",
    created_at: job.created_at,
    error:
      status === "failed"
        ? { code: "training_failed", message: job.error_message ?? "training failed", param: null }
        : null,
    fine_tuned_model: status === "succeeded" ? ft.fine_tuned_model : null,
    finished_at: ended ? job.training_end : null,
    hyperparameters,
    model: ft.base_model,
    organization_id: ft.entity,
    result_files: [],
    seed: ft.seed,
    status,
    trained_tokens: status === "succeeded" ? ft.trained_tokens : null,
    training_file: ft.training_file,
    validation_file: ft.validation_file,
    estimated_finish: estimated,
    metadata: ft.metadata,
    method,
    training_job_id: job.id,
    model_id: job.model_id,
  };
}

const num = (v: unknown): number | undefined =>
  typeof v === "number" && Number.isFinite(v) ? v : undefined;

/** A metric's value rounded for a message. */
const shown = (v: number | undefined) => (v === undefined ? "n/a" : v.toFixed(4));

/** An Arbor job event as OpenAI's (ADR 70): steps and validations are `metrics` events. */
export function eventToFineTuningEvent(
  event: JobEvent,
  ft: FineTuningJob,
  job: TrainingJob,
  totalSteps: number | null,
): Schemas["FineTuningJobEvent"] {
  const data = (event.data ?? {}) as Record<string, unknown>;
  const base = {
    id: eventIds.of(event.id),
    object: "fine_tuning.job.event" as const,
    created_at: event.created_at,
  };
  const message = (text: string, extra: Record<string, unknown> = {}, level = "info" as const) => ({
    ...base,
    level,
    message: text,
    type: "message" as const,
    data: extra,
  });
  const of = totalSteps === null ? "" : `/${totalSteps}`;
  switch (event.type) {
    case "training_started": {
      const total = num(data.num_sequences);
      const resumed = num(data.resumed_from_step);
      return resumed === undefined
        ? message(`Fine-tuning started${total === undefined ? "" : ` (${total} steps)`}.`, {
            total_steps: total ?? null,
          })
        : message(`Fine-tuning resumed after step ${resumed} (run ${num(data.attempt) ?? 2}).`, {
            total_steps: total ?? null,
            resumed_from_step: resumed,
          });
    }
    case "gradient_step": {
      const step = num(data.gradient_step) ?? 0;
      const metrics: Record<string, unknown> = { step, train_loss: num(data.loss) ?? null };
      if (totalSteps !== null) metrics.total_steps = totalSteps;
      for (const [key, value] of Object.entries(data)) {
        if (key === "gradient_step" || key === "loss" || num(value) === undefined) continue;
        metrics[key === "mean_token_accuracy" ? "train_mean_token_accuracy" : key] = value;
      }
      return {
        ...base,
        level: "info",
        message: `Step ${step}${of}: training loss=${shown(num(data.loss))}`,
        type: "metrics",
        data: metrics,
      };
    }
    case "validation": {
      const step = num(data.gradient_step) ?? 0;
      return {
        ...base,
        level: "info",
        message: `Step ${step}${of}: validation loss=${shown(num(data.loss))}`,
        type: "metrics",
        data: {
          step,
          ...(totalSteps === null ? {} : { total_steps: totalSteps }),
          valid_loss: num(data.loss) ?? null,
          ...(num(data.mean_token_accuracy) === undefined
            ? {}
            : { valid_mean_token_accuracy: num(data.mean_token_accuracy) }),
        },
      };
    }
    case "checkpoint_saved": {
      const step = (num(data.step) ?? 0) - (job.step_from ?? 0);
      return message(`Checkpoint created at step ${step}.`, {
        step,
        fine_tuned_model_checkpoint: checkpointName(ft.fine_tuned_model, step),
      });
    }
    case "training_ended":
      return message("The job has successfully completed.", {
        fine_tuned_model: ft.fine_tuned_model,
      });
    case "training_failed": {
      const why = typeof data.error_message === "string" ? data.error_message : "failed";
      return why === "cancelled"
        ? message("The job was cancelled.")
        : message(`The job failed: ${why}`, { error: why }, "error" as never);
    }
    default:
      return message(event.type, data);
  }
}

/** The event OpenAI lists first of a job (last, newest first): its creation. */
export function createdEvent(ft: FineTuningJob, job: TrainingJob): Schemas["FineTuningJobEvent"] {
  return {
    id: eventIds.of(job.id),
    object: "fine_tuning.job.event",
    created_at: ft.created_at,
    level: "info",
    message: `Created fine-tuning job: ${jobIds.of(job.id)}`,
    type: "message",
    data: {},
  };
}

/** A checkpoint's step metrics as OpenAI names them. */
export function checkpointToWire(
  ft: FineTuningJob,
  job: TrainingJob,
  checkpoint: Checkpoint,
): Schemas["FineTuningJobCheckpoint"] {
  const m = (checkpoint.metrics ?? {}) as Record<string, unknown>;
  const step = checkpoint.step - (job.step_from ?? 0);
  const metrics: Schemas["FineTuningJobCheckpoint"]["metrics"] = { step };
  const names = {
    "train/loss": "train_loss",
    "train/mean_token_accuracy": "train_mean_token_accuracy",
    "validation/loss": "valid_loss",
    "validation/mean_token_accuracy": "valid_mean_token_accuracy",
  } as const;
  for (const [from, to] of Object.entries(names)) {
    const value = num(m[from]);
    if (value !== undefined) metrics[to] = value;
  }
  return {
    id: checkpointIds.of(checkpoint.id),
    object: "fine_tuning.job.checkpoint",
    created_at: checkpoint.created_at,
    fine_tuned_model_checkpoint: checkpointName(ft.fine_tuned_model, step),
    fine_tuning_job_id: jobIds.of(job.id),
    step_number: step,
    metrics,
  };
}
