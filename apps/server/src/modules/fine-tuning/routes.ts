import { randomInt } from "node:crypto";
import type { BaseModelFolder } from "@arbor/engine/model";
import type { components } from "@arbor/spec/schema";
import {
  ConflictError,
  InvalidInputError,
  type Json,
  NotFoundError,
  quote,
  type Store,
  TERMINAL_STATUSES,
  type TrainingJob,
} from "@arbor/store";
import {
  createDataset,
  DATASET_MAX_BYTES,
  datasetUrl,
  defaultLearningRate,
  enqueueSftJob,
} from "@arbor/training";
import type { Request } from "express";
import { ApiError } from "../../http/errors.ts";
import { type Handlers, RESPONDED } from "../../http/operations.ts";
import type { Principal } from "../access.ts";
import {
  checkpointIds,
  checkpointToWire,
  createdEvent,
  eventIds,
  eventToFineTuningEvent,
  fileIds,
  fileToWire,
  findFile,
  findFineTuningJob,
  fineTunedModelName,
  fineTuningJobToWire,
  jobIds,
  parseFineTunedName,
} from "./service.ts";

type Schemas = components["schemas"];
type Hyperparameters = Schemas["FineTuningHyperparameters"];

export interface FineTuningDeps {
  store: Store;
  /** A base model the engine serves (and so can train), by id. */
  baseModel: (id: string) => Promise<BaseModelFolder | undefined>;
  onJobQueued?: () => void;
  /** Told when a job was cancelled or paused here, so a worker in this process stops it. */
  onJobCancelled?: (jobId: string) => void;
}

/** The project a fine-tuning job's model is created in. */
export const FINE_TUNING_PROJECT = "fine-tuning";

/** OpenAI's files and fine-tuning jobs over Arbor's datasets and SFT jobs (ADR 70). */
export function fineTuningHandlers(deps: FineTuningDeps): Handlers {
  const { store } = deps;
  const now = () => Math.floor(Date.now() / 1000);
  const wire = async (ft: Parameters<typeof fineTuningJobToWire>[0], job: TrainingJob) => {
    let withTokens = ft;
    if (job.status === "succeeded" && ft.trained_tokens === null) {
      const tokens = await store.jobs.trainedTokens(job.id);
      await store.fineTuningJobs.setTrainedTokens(ft.id, tokens);
      withTokens = { ...ft, trained_tokens: tokens };
    }
    const progress = (await store.jobs.progress([job.id])).get(job.id) ?? null;
    return fineTuningJobToWire(withTokens, job, progress, now());
  };

  return {
    createFile: async ({ req, project }) => {
      const purpose = (req.body as { purpose?: unknown } | undefined)?.purpose;
      if (purpose !== "fine-tune") {
        throw new InvalidInputError(
          `purpose must be "fine-tune" (the only purpose this server stores files for), got ${quote(String(purpose ?? ""))}.`,
          { param: "purpose", code: "invalid_purpose" },
        );
      }
      const file = uploadedFile(req);
      if (file.size > DATASET_MAX_BYTES) {
        throw ApiError.tooLarge(
          `The file is ${file.size} bytes; fine-tuning files hold at most ${DATASET_MAX_BYTES}.`,
        );
      }
      const text = decodeUtf8(file.parts);
      if (!/\S/.test(text)) {
        throw new InvalidInputError(
          "The file is empty: a fine-tuning file holds one JSON example per line.",
          {
            param: "file",
            code: "invalid_file_format",
          },
        );
      }
      try {
        const dataset = await createDataset(store, {
          entity: project.entity,
          name: null,
          filename: file.name,
          text,
        });
        return fileToWire(dataset);
      } catch (err) {
        if (err instanceof InvalidInputError) {
          throw new InvalidInputError(err.message, { param: "file", code: "invalid_file_format" });
        }
        throw err;
      }
    },

    listFiles: async ({ query, principal }) => {
      const limit = query.limit ?? 100;
      if (query.purpose !== undefined && query.purpose !== "fine-tune") {
        return { object: "list", data: [], has_more: false, first_id: null, last_id: null };
      }
      const after = query.after === undefined ? undefined : fileIds.uuid(query.after);
      if (query.after !== undefined && after === undefined) throw badCursor(query.after);
      const page = await store.datasets.list(principal.entities, {
        after,
        limit,
        order: query.order ?? "desc",
      });
      const data = page.data.map(fileToWire);
      return {
        object: "list",
        data,
        has_more: page.has_more,
        first_id: data[0]?.id ?? null,
        last_id: data.at(-1)?.id ?? null,
      };
    },

    retrieveFile: async ({ params, principal }) =>
      fileToWire(await findFile(store, principal, params.file_id)),

    retrieveFileContent: async ({ params, principal, res }): Promise<typeof RESPONDED> => {
      const dataset = await findFile(store, principal, params.file_id);
      const stream = await store.blobs.stream(dataset.blob_key);
      if (!stream) throw new Error(`Dataset ${dataset.id} has a row but no blob.`);
      res.status(200).type("application/octet-stream");
      res.setHeader("Content-Length", String(dataset.bytes));
      await new Promise<void>((resolve, reject) => {
        stream.on("error", reject);
        res.on("close", resolve);
        stream.pipe(res);
      });
      return RESPONDED;
    },

    deleteFile: async ({ params, principal }) => {
      const dataset = await findFile(store, principal, params.file_id);
      const reader = await store.fineTuningJobs.readingFile(dataset.entity, params.file_id);
      const running = await store.jobs.unfinishedReading(datasetUrl(dataset.id));
      if (reader || running) {
        const by = reader ? jobIds.of(reader.job_id) : `training job ${running}`;
        throw new ConflictError(
          `File ${params.file_id} is read by job ${by}, which has not ended; cancel it first.`,
          { param: "file_id", code: "file_in_use" },
        );
      }
      const deleted = await store.datasets.delete(dataset.entity, dataset.id);
      if (deleted) await store.blobs.delete(deleted.blob_key).catch(() => {});
      return { id: params.file_id, object: "file", deleted: true };
    },

    createFineTuningJob: async ({ body, project, principal }) => {
      const entity = project.entity;
      const method = body.method ?? { type: "supervised" as const };
      if (method.type === "reinforcement") {
        throw new InvalidInputError(
          "method reinforcement (OpenAI's graders) is not served: train with rewards through Arbor's RL jobs or training runs.",
          { param: "method.type", code: "unsupported_method" },
        );
      }
      const dpo = method.type === "dpo";
      const asked: Hyperparameters =
        (dpo ? method.dpo?.hyperparameters : method.supervised?.hyperparameters) ??
        body.hyperparameters ??
        {};
      if (!dpo && asked.beta !== undefined) {
        throw new InvalidInputError("beta is DPO's: set method.type to dpo, or leave beta out.", {
          param: "hyperparameters.beta",
          code: "invalid_hyperparameters",
        });
      }
      if (dpo && body.validation_file != null) {
        throw new InvalidInputError(
          "validation_file holds supervised examples; a DPO job takes no validation file yet.",
          { param: "validation_file", code: "unsupported_validation_file" },
        );
      }
      const training = await fileFor(store, principal, entity, body.training_file, "training_file");
      const validation =
        body.validation_file == null
          ? undefined
          : await fileFor(store, principal, entity, body.validation_file, "validation_file");

      // The model to train: a base the engine serves, or a fine-tuned model to go on from.
      const from = parseFineTunedName(body.model);
      let baseModel: string;
      let modelId: string | undefined;
      if (from) {
        const earlier = await store.fineTuningJobs.byFineTunedModel(principal.entities, from.name);
        const earlierJob = earlier
          ? await store.jobs.get(earlier.entity, earlier.job_id)
          : undefined;
        if (
          !earlier ||
          earlierJob?.status !== "succeeded" ||
          from.step !== null ||
          earlier.entity !== entity
        ) {
          throw new InvalidInputError(
            `model ${quote(body.model)} is not a fine-tuned model of ${quote(entity)} whose job succeeded.`,
            { param: "model", code: "model_not_found" },
          );
        }
        modelId = earlierJob.model_id;
        const model = await store.models.get(entity, modelId);
        if (!model)
          throw new InvalidInputError(`model ${quote(body.model)} was deleted.`, {
            param: "model",
            code: "model_not_found",
          });
        baseModel = model.base_model;
      } else {
        baseModel = body.model;
      }
      const base = await deps.baseModel(baseModel);
      if (!base) {
        throw new InvalidInputError(
          `model ${quote(body.model)} is not a base model this server trains (see GET /v1/models).`,
          { param: "model", code: "model_not_found" },
        );
      }
      const hyperparameters = resolveHyperparameters(asked, training.lines, dpo);
      const seed = body.seed ?? randomInt(2 ** 31);
      const suffix = body.suffix ? body.suffix : null;

      // A model of its own (in project `fine-tuning`), unless going on from a fine-tuned one.
      const created =
        modelId === undefined
          ? (
              await store.models.create({
                entity,
                project: FINE_TUNING_PROJECT,
                name: `${suffix ?? "ft"}-${store.datasets.newId().replaceAll("-", "").slice(-12)}`,
                base_model: base.id,
                initialCheckpoint: { step: 0, blob_key: null },
              })
            ).model
          : undefined;
      const model = created ?? (await store.models.get(entity, modelId!))!;
      try {
        const job = await enqueueSftJob(store, model, {
          training_data_url: datasetUrl(training.id),
          ...(validation ? { validation_data_url: datasetUrl(validation.id) } : {}),
          config: {
            epochs: hyperparameters.n_epochs,
            batch_size: hyperparameters.batch_size,
            // A checkpoint at the end of each epoch, as OpenAI keeps them, when the steps of an
            // epoch are known (a fixed batch size); else at the end only.
            ...(typeof hyperparameters.batch_size === "number"
              ? { checkpoint_every: Math.ceil(training.lines / hyperparameters.batch_size) }
              : {}),
            learning_rate:
              defaultLearningRate(base.parameters) * hyperparameters.learning_rate_multiplier,
            ...(dpo ? { method: "dpo" as const, dpo_beta: hyperparameters.beta } : {}),
          },
          experimental_config: { seed },
        });
        const ft = await store.fineTuningJobs.create({
          id: jobIds.of(job.id),
          job_id: job.id,
          entity,
          fine_tuned_model: fineTunedModelName(base.id, entity, suffix, job.id),
          base_model: body.model,
          training_file: body.training_file,
          validation_file: body.validation_file ?? null,
          suffix,
          seed,
          method: { type: method.type, [method.type]: { hyperparameters } } as Json,
          hyperparameters: hyperparameters as unknown as Json,
          metadata: body.metadata ?? null,
        });
        deps.onJobQueued?.();
        return await wire(ft, job);
      } catch (err) {
        // Nothing half-made stays: the model made for this job goes, with its job.
        if (created) await store.models.delete(entity, created.id).catch(() => {});
        throw inOpenAiTerms(err);
      }
    },

    listFineTuningJobs: async ({ query, principal }) => {
      const metadata = metadataFilter(query.metadata);
      if (query.after !== undefined && jobIds.uuid(query.after) === undefined) {
        throw badCursor(query.after);
      }
      const page = await store.fineTuningJobs.list(principal.entities, {
        after: query.after,
        limit: query.limit ?? 20,
        metadata,
      });
      const data: Schemas["FineTuningJob"][] = [];
      for (const ft of page.data) {
        const job = await store.jobs.get(ft.entity, ft.job_id);
        if (job) data.push(await wire(ft, job));
      }
      return { object: "list", data, has_more: page.has_more };
    },

    retrieveFineTuningJob: async ({ params, principal }) => {
      const { ft, job } = await findFineTuningJob(store, principal, params.fine_tuning_job_id);
      return wire(ft, job);
    },

    cancelFineTuningJob: async ({ params, principal }) => {
      const { ft, job } = await findFineTuningJob(store, principal, params.fine_tuning_job_id);
      if (TERMINAL_STATUSES.includes(job.status)) throw ended(params.fine_tuning_job_id, job);
      const cancelled = await store.jobs.cancelJob(job.entity, job.id);
      deps.onJobCancelled?.(job.id);
      return wire(ft, cancelled);
    },

    pauseFineTuningJob: async ({ params, principal }) => {
      const { ft, job } = await findFineTuningJob(store, principal, params.fine_tuning_job_id);
      const paused = await store.jobs.pauseJob(job.entity, job.id);
      if (!paused) {
        throw new ConflictError(
          `Fine-tuning job ${params.fine_tuning_job_id} is ${job.paused_at !== null && job.status === "queued" ? "paused already" : job.status}: only a queued or running job pauses.`,
          { code: "job_not_running" },
        );
      }
      // A worker of this process running it stops at its next micro-batch.
      if (job.status === "running") deps.onJobCancelled?.(job.id);
      return wire(ft, paused);
    },

    resumeFineTuningJob: async ({ params, principal }) => {
      const { ft, job } = await findFineTuningJob(store, principal, params.fine_tuning_job_id);
      const resumed = await store.jobs.resumeJob(job.entity, job.id);
      if (!resumed) {
        throw new ConflictError(
          `Fine-tuning job ${params.fine_tuning_job_id} is not paused (it is ${job.status}).`,
          { code: "job_not_paused" },
        );
      }
      deps.onJobQueued?.();
      return wire(ft, resumed);
    },

    listFineTuningEvents: async ({ params, query, principal }) => {
      const { ft, job } = await findFineTuningJob(store, principal, params.fine_tuning_job_id);
      const limit = query.limit ?? 20;
      const created = createdEvent(ft, job);
      // The creation event is the oldest: past it there is nothing.
      if (query.after === created.id) return { object: "list", data: [], has_more: false };
      const after = query.after === undefined ? undefined : eventIds.uuid(query.after);
      if (query.after !== undefined && after === undefined) throw badCursor(query.after);
      const page = await store.jobs.listEvents(job.entity, job.id, { after, limit, order: "desc" });
      const total = (await store.jobs.progress([job.id])).get(job.id)?.total_steps ?? null;
      const data = page.data.map((e) => eventToFineTuningEvent(e, ft, job, total));
      if (page.has_more || data.length === limit) return { object: "list", data, has_more: true };
      return { object: "list", data: [...data, created], has_more: false };
    },

    listFineTuningJobCheckpoints: async ({ params, query, principal }) => {
      const { ft, job } = await findFineTuningJob(store, principal, params.fine_tuning_job_id);
      const after = query.after === undefined ? undefined : checkpointIds.uuid(query.after);
      if (query.after !== undefined && after === undefined) throw badCursor(query.after);
      const page = await store.models.listCheckpoints(job.entity, job.model_id, {
        after,
        limit: query.limit ?? 20,
        order: "desc",
      });
      // The model's checkpoints this job wrote: past its first step, up to its last.
      const from = job.step_from ?? 0;
      const data = page.data
        .filter((c) => c.step > from && (job.step_to === null || c.step <= job.step_to))
        .map((c) => checkpointToWire(ft, job, c));
      return {
        object: "list",
        data,
        has_more: page.has_more,
        first_id: data[0]?.id ?? null,
        last_id: page.last_id === null ? null : checkpointIds.of(page.last_id),
      };
    },
  };
}

/** `createFile`'s `file` part, as the validator's multer keeps it (in blocks). */
function uploadedFile(req: Request): { name: string; parts: Uint8Array[]; size: number } {
  const files = (
    req as {
      files?: { fieldname: string; originalname?: string; parts: Uint8Array[]; size: number }[];
    }
  ).files;
  const file = files?.find((f) => f.fieldname === "file");
  if (!file) {
    throw new InvalidInputError("The upload has no `file` part.", {
      param: "file",
      code: "invalid_file",
    });
  }
  // Busboy reads a part's file name as Latin-1; clients send UTF-8.
  const name = Buffer.from(file.originalname ?? "file.jsonl", "latin1")
    .toString("utf8")
    .slice(0, 256);
  return { name: name || "file.jsonl", parts: file.parts, size: file.size };
}

function decodeUtf8(parts: readonly Uint8Array[]): string {
  try {
    return new TextDecoder("utf-8", { fatal: true }).decode(Buffer.concat(parts));
  } catch {
    throw new InvalidInputError("The file is not UTF-8 text.", {
      param: "file",
      code: "invalid_file_format",
    });
  }
}

/** A file of the job's entity, named by `param`: 400 (OpenAI's `invalid_…_file`) otherwise. */
async function fileFor(
  store: Store,
  principal: Principal,
  entity: string,
  id: string,
  param: string,
) {
  try {
    const dataset = await findFile(store, principal, id);
    if (dataset.entity === entity) return dataset;
  } catch (err) {
    if (!(err instanceof NotFoundError)) throw err;
  }
  throw new InvalidInputError(`${param} ${quote(id)} is not a file of ${quote(entity)}.`, {
    param,
    code: `invalid_${param}`,
  });
}

/** OpenAI's `auto`s made numbers (ADR 70): 3 epochs up to 1,000 examples, then about 3,000
 * examples seen in all, at least one pass; batch size packed by tokens; multiplier 1; DPO's
 * beta 0.1. */
function resolveHyperparameters(asked: Hyperparameters, lines: number, dpo: boolean) {
  const epochs =
    asked.n_epochs === undefined || asked.n_epochs === "auto"
      ? Math.max(1, Math.min(3, Math.round(3000 / Math.max(1, lines))))
      : asked.n_epochs;
  return {
    n_epochs: epochs,
    batch_size: asked.batch_size === undefined ? ("auto" as const) : asked.batch_size,
    learning_rate_multiplier:
      asked.learning_rate_multiplier === undefined || asked.learning_rate_multiplier === "auto"
        ? 1
        : asked.learning_rate_multiplier,
    ...(dpo ? { beta: asked.beta === undefined || asked.beta === "auto" ? 0.1 : asked.beta } : {}),
  };
}

/** The SFT job's refusal, its parameter named as the fine-tuning request names it (a file of
 * the other kind is the training file's fault, not `config.method`'s). */
function inOpenAiTerms(err: unknown): unknown {
  if (!(err instanceof InvalidInputError)) return err;
  const param =
    {
      "config.method": "training_file",
      training_data_url: "training_file",
      validation_data_url: "validation_file",
    }[err.param ?? ""] ?? err.param;
  if (param === err.param) return err;
  return new InvalidInputError(err.message, {
    param: param ?? undefined,
    code: err.code ?? undefined,
  });
}

function metadataFilter(value: unknown): Record<string, string> | null | undefined {
  if (value === undefined) return undefined;
  if (value === "null") return null;
  return value as Record<string, string>;
}

function badCursor(after: string): InvalidInputError {
  return new InvalidInputError(`after ${quote(after)} is not an id of this list.`, {
    param: "after",
    code: "invalid_cursor",
  });
}

function ended(id: string, job: TrainingJob): ConflictError {
  return new ConflictError(
    `Fine-tuning job ${id} has already ${job.status === "cancelled" ? "been cancelled" : job.status}.`,
    {
      code: "job_already_ended",
    },
  );
}
