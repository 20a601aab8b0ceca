import type { Core, RequestOptions } from "../core.ts";
import { data, PagePromise } from "../core.ts";
import { unwrap } from "../errors.ts";
import type { components, operations } from "../generated/schema.ts";
import { sseJson } from "../sse.ts";

type Schemas = components["schemas"];
type Query<Op extends keyof operations> = NonNullable<operations[Op]["parameters"]["query"]>;

export type Model = Schemas["Model"];
export type Checkpoint = Schemas["Checkpoint"];
export type Dataset = Schemas["Dataset"];
export type DatasetLine = Schemas["DatasetLine"];
export type SftExample = Schemas["SftExample"];
/** A DPO preference pair, a line of a dataset a `config.method: "dpo"` job trains on. */
export type DpoExample = Schemas["DpoExample"];
export type TrainingJob = Schemas["TrainingJob"];
/** A job's event: a union by `type`; narrow on it to read its typed `data`. */
export type TrainingJobEvent = Schemas["TrainingJobEvent"];
export type TrainingRun = Schemas["TrainingRun"];
/** An operation with its loss, tokens and learner version, as `runs.operations` lists it. */
export type TrainingOperationProgress = Awaited<ReturnType<Runs["operations"]>>["data"][number];
export type TrainingStartedEvent = Schemas["TrainingStartedEvent"];
export type GradientStepEvent = Schemas["GradientStepEvent"];
/** The job's validation set evaluated after a step (jobs with a `validation_data_url`). */
export type ValidationEvent = Schemas["ValidationEvent"];
export type CheckpointSavedEvent = Schemas["CheckpointSavedEvent"];
export type TrainingEndedEvent = Schemas["TrainingEndedEvent"];
export type TrainingFailedEvent = Schemas["TrainingFailedEvent"];
export type PullBaseModelRequest = Schemas["PullBaseModelRequest"];
export type PulledBaseModel = Schemas["PulledBaseModel"];
/** `peft`: PEFT's two files in a tar; `gguf`: the base with the adapter merged; `gguf-lora`:
 * the adapter as a llama.cpp LoRA GGUF. */
export type CheckpointFormat = NonNullable<Query<"getCheckpointContent">["format"]>;
/** With format `gguf`: the weight matrices as `f32` (the default) or ggml's `q8_0`. */
export type GgufOuttype = NonNullable<Query<"getCheckpointContent">["outtype"]>;

/** A checkpoint's weights as they stream, with what the server states of them. */
export interface CheckpointContent {
  body: ReadableStream<Uint8Array>;
  /** Content-Length. */
  bytes: number;
  /** Repr-Digest: `sha-256=:<base64>:` (RFC 9530). */
  digest: string | null;
  /** The file name of Content-Disposition. */
  filename: string | null;
}

/** What `datasets.create` uploads: JSONL text or bytes, or examples (objects or JSON lines;
 * SFT examples or DPO pairs, one kind per dataset) from any iterable, sync or async. */
export type DatasetInput =
  | string
  | Blob
  | Uint8Array
  | Iterable<SftExample | DpoExample | string>
  | AsyncIterable<SftExample | DpoExample | string>;

const terminalEventTypes = new Set(["training_ended", "training_failed"]);
/** Pause before following a job's events again after the stream closed without its end. */
const reconnectDelayMs = 1000;

/** `client.training`: trainable models, checkpoints, datasets and jobs, and base models. */
export class Training {
  readonly models: TrainingModels;
  readonly datasets: Datasets;
  readonly jobs: Jobs;
  readonly runs: Runs;
  readonly baseModels: BaseModels;
  constructor(core: Core) {
    this.models = new TrainingModels(core);
    this.datasets = new Datasets(core);
    this.jobs = new Jobs(core);
    this.runs = new Runs(core);
    this.baseModels = new BaseModels(core);
  }
}

/**
 * `client.training.runs`: the native training runs (ADR 57) as an operator or a console reads
 * them. Driving a run (resolve, commands, results) is ART's: the raw `client.POST` reaches it.
 */
export class Runs {
  readonly #core: Core;
  constructor(core: Core) {
    this.#core = core;
  }

  /** The key's runs, newest first; optionally those in one status. */
  list(
    query: Omit<Query<"listTrainingRuns">, "after"> = {},
    options?: RequestOptions,
  ): PagePromise<TrainingRun> {
    return new PagePromise((after) =>
      data(
        this.#core.api.GET("/v1/training/runs", {
          params: { query: { ...query, after } },
          ...this.#core.init(options),
        }),
      ),
    );
  }

  retrieve(runId: string, options?: RequestOptions): Promise<TrainingRun> {
    return data(
      this.#core.api.GET("/v1/training/runs/{run_id}", {
        params: { path: { run_id: runId } },
        ...this.#core.init(options),
      }),
    );
  }

  /** The run's operations in sequence order, each with its loss, tokens and learner version. */
  operations(
    runId: string,
    query: Omit<Query<"listTrainingOperations">, "after"> = {},
    options?: RequestOptions,
  ) {
    return new PagePromise((after) =>
      data(
        this.#core.api.GET("/v1/training/runs/{run_id}/operations", {
          params: { path: { run_id: runId }, query: { ...query, after } },
          ...this.#core.init(options),
        }),
      ),
    );
  }
}

/** `client.training.baseModels`: base models pulled from the Hugging Face Hub (admin keys). */
export class BaseModels {
  readonly #core: Core;
  constructor(core: Core) {
    this.#core = core;
  }

  /** Pulls a model from the Hub as a base model, answering when it is in place: minutes for a
   * large one, so give it a `timeout` (the default is 10 minutes). Not retried, as any POST
   * without an `Idempotency-Key`; asking again is safe (409 while it runs, then the model). */
  pull(body: PullBaseModelRequest, options?: RequestOptions): Promise<PulledBaseModel> {
    return data(
      this.#core.api.POST("/v1/preview/base-models/pull", { body, ...this.#core.init(options) }),
    );
  }
}

export class TrainingModels {
  readonly #core: Core;
  readonly checkpoints: Checkpoints;
  constructor(core: Core) {
    this.#core = core;
    this.checkpoints = new Checkpoints(core);
  }

  /** A model on a base model, with its step-0 checkpoint (`return_existing` to get a
   * duplicate back instead of a ConflictError). */
  create(body: Schemas["CreateModelRequest"], options?: RequestOptions): Promise<Model> {
    return data(
      this.#core.api.POST("/v1/preview/models", { body, ...this.#core.init(options) }),
    ) as Promise<Model>; // openapi-fetch's Readable<> drops `run_id: null`; the wire has it.
  }

  /** The key's models, newest first. */
  list(
    query: Omit<Query<"listTrainableModels">, "after"> = {},
    options?: RequestOptions,
  ): PagePromise<Model> {
    return new PagePromise(
      (after) =>
        data(
          this.#core.api.GET("/v1/preview/models", {
            params: { query: { ...query, after } },
            ...this.#core.init(options),
          }),
        ) as Promise<Schemas["TrainableModelList"]>, // as in `create`: `run_id: null`
    );
  }

  /** Deletes the model, its checkpoints and files; a queued or running job is cancelled. */
  delete(modelId: string, options?: RequestOptions): Promise<Schemas["DeleteModelResponse"]> {
    return data(
      this.#core.api.DELETE("/v1/preview/models/{model_id}", {
        params: { path: { model_id: modelId } },
        ...this.#core.init(options),
      }),
    );
  }

  /** Merges metrics into checkpoints as `<split>/<metric>`. */
  log(
    modelId: string,
    body: Schemas["LogModelMetricsRequest"],
    options?: RequestOptions,
  ): Promise<Schemas["LogModelMetricsResponse"]> {
    return data(
      this.#core.api.POST("/v1/preview/models/{model_id}/log", {
        params: { path: { model_id: modelId } },
        body,
        ...this.#core.init(options),
      }),
    );
  }
}

export class Checkpoints {
  readonly #core: Core;
  constructor(core: Core) {
    this.#core = core;
  }

  /** The model's checkpoints by step, oldest first unless `order: "desc"`. */
  list(
    modelId: string,
    query: Omit<Query<"listCheckpoints">, "after"> = {},
    options?: RequestOptions,
  ): PagePromise<Checkpoint> {
    return new PagePromise((after) =>
      data(
        this.#core.api.GET("/v1/preview/models/{model_id}/checkpoints", {
          params: { path: { model_id: modelId }, query: { ...query, after } },
          ...this.#core.init(options),
        }),
      ),
    );
  }

  /** Deletes checkpoints by step (the latest cannot go: ConflictError). */
  delete(
    modelId: string,
    steps: number[],
    options?: RequestOptions,
  ): Promise<Schemas["DeleteCheckpointsResponse"]> {
    return data(
      this.#core.api.DELETE("/v1/preview/models/{model_id}/checkpoints", {
        params: { path: { model_id: modelId } },
        body: { steps },
        ...this.#core.init(options),
      }),
    );
  }

  /** A checkpoint's weights, streamed: a PEFT tar, or a GGUF file (F32, or Q8_0 with
   * `outtype: "q8_0"`). */
  async download(
    modelId: string,
    step: number,
    query: { format?: CheckpointFormat; outtype?: GgufOuttype } = {},
    options?: RequestOptions,
  ): Promise<CheckpointContent> {
    const result = await this.#core.api.GET(
      "/v1/preview/models/{model_id}/checkpoints/{step}/content",
      {
        params: { path: { model_id: modelId, step }, query },
        parseAs: "stream",
        ...this.#core.init(options),
      },
    );
    // openapi-fetch has already read an error's body into `result.error`.
    if (!result.response.ok || !result.data) unwrap(result);
    const headers = result.response.headers;
    return {
      body: result.data as ReadableStream<Uint8Array>,
      bytes: Number(headers.get("content-length")),
      digest: headers.get("repr-digest"),
      filename: /filename="([^"]+)"/.exec(headers.get("content-disposition") ?? "")?.[1] ?? null,
    };
  }

  /** Adds a PEFT adapter (a tar of `adapter_config.json` and `adapter_model.safetensors`,
   * gzipped or not) as the model's next checkpoint. */
  upload(
    modelId: string,
    tar: Uint8Array | Blob,
    options: RequestOptions = {},
  ): Promise<Checkpoint> {
    const head = tar instanceof Uint8Array ? tar : undefined;
    const gzipped =
      head !== undefined
        ? head[0] === 0x1f && head[1] === 0x8b
        : (tar as Blob).type === "application/gzip";
    const init = this.#core.init(options);
    return data(
      this.#core.api.POST("/v1/preview/models/{model_id}/checkpoints", {
        params: { path: { model_id: modelId } },
        // The spec types a binary body as a string; fetch sends the bytes as they are.
        body: tar as unknown as string,
        bodySerializer: (bytes: unknown) => bytes as string,
        ...init,
        headers: {
          "content-type": gzipped ? "application/gzip" : "application/x-tar",
          ...init.headers,
        },
      }),
    );
  }
}

export class Datasets {
  readonly #core: Core;
  constructor(core: Core) {
    this.#core = core;
  }

  /** Uploads SFT examples (or DPO preference pairs) as JSONL; every line is checked, and a bad
   * one is a BadRequestError naming its line. The answer's `url` is a job's `training_data_url`. */
  async create(
    input: DatasetInput,
    query: { name?: string } = {},
    options: RequestOptions = {},
  ): Promise<Dataset> {
    const body = await jsonlBody(input);
    const init = this.#core.init(options);
    return data(
      this.#core.api.POST("/v1/preview/datasets", {
        params: { query },
        body: body as string,
        bodySerializer: (b: unknown) => b as string,
        ...init,
        headers: { "content-type": "application/jsonl", ...init.headers },
      }),
    );
  }

  /** The datasets of every entity the key may use, newest first; `name` keeps those uploaded
   * under it. */
  list(
    query: Omit<Query<"listDatasets">, "after"> = {},
    options?: RequestOptions,
  ): PagePromise<Dataset> {
    return new PagePromise((after) =>
      data(
        this.#core.api.GET("/v1/preview/datasets", {
          params: { query: { ...query, after } },
          ...this.#core.init(options),
        }),
      ),
    );
  }

  /** The dataset's examples as parsed for training, in file order. */
  lines(datasetId: string, query: { limit?: number } = {}, options?: RequestOptions) {
    return new PagePromise<DatasetLine>((after) =>
      data(
        this.#core.api.GET("/v1/preview/datasets/{dataset_id}/lines", {
          params: { path: { dataset_id: datasetId }, query: { ...query, after } },
          ...this.#core.init(options),
        }),
      ),
    );
  }
}

/** JSONL text or bytes as they are; examples one JSON object per line. */
async function jsonlBody(input: DatasetInput): Promise<string | Blob | Uint8Array> {
  if (typeof input === "string" || input instanceof Uint8Array || input instanceof Blob)
    return input;
  const lines: string[] = [];
  for await (const item of input as AsyncIterable<SftExample | DpoExample | string>)
    lines.push(typeof item === "string" ? item : JSON.stringify(item));
  return lines.join("\n");
}

export class Jobs {
  readonly #core: Core;
  readonly events: Events;
  constructor(core: Core) {
    this.#core = core;
    this.events = new Events(core);
  }

  /** Queues an SFT job on an uploaded dataset (`training_data_url`); with `config.method:
   * "dpo"`, a DPO job on preference pairs (ADR 69). */
  createSft(
    body: Schemas["CreateSftTrainingJobRequest"],
    options?: RequestOptions,
  ): Promise<TrainingJob> {
    return data(
      this.#core.api.POST("/v1/preview/sft-training-jobs", { body, ...this.#core.init(options) }),
    );
  }

  /** Queues one RL step on trajectory groups. */
  createRl(
    body: Schemas["CreateRlTrainingJobRequest"],
    options?: RequestOptions,
  ): Promise<TrainingJob> {
    return data(
      this.#core.api.POST("/v1/preview/training-jobs", { body, ...this.#core.init(options) }),
    );
  }

  retrieve(trainingJobId: string, options?: RequestOptions): Promise<TrainingJob> {
    return data(
      this.#core.api.GET("/v1/preview/training-jobs/{training_job_id}", {
        params: { path: { training_job_id: trainingJobId } },
        ...this.#core.init(options),
      }),
    );
  }

  /** The key's jobs, newest first; of one model, project or status. */
  list(
    query: Omit<Query<"listTrainingJobs">, "after"> = {},
    options?: RequestOptions,
  ): PagePromise<TrainingJob> {
    return new PagePromise((after) =>
      data(
        this.#core.api.GET("/v1/preview/training-jobs", {
          params: { query: { ...query, after } },
          ...this.#core.init(options),
        }),
      ),
    );
  }

  /** Cancels a queued or running job (an ended one is a ConflictError). */
  cancel(trainingJobId: string, options?: RequestOptions): Promise<TrainingJob> {
    return data(
      this.#core.api.POST("/v1/preview/training-jobs/{training_job_id}/cancel", {
        params: { path: { training_job_id: trainingJobId } },
        ...this.#core.init(options),
      }),
    );
  }
}

export class Events {
  readonly #core: Core;
  constructor(core: Core) {
    this.#core = core;
  }

  /** The job's events so far, oldest first. */
  list(
    trainingJobId: string,
    query: { limit?: number } = {},
    options: RequestOptions = {},
  ): PagePromise<TrainingJobEvent> {
    return new PagePromise((after) => {
      const init = this.#core.init(options);
      // Typed as either media type's body; with `accept: application/json` it is the list.
      return data(
        this.#core.api.GET("/v1/preview/training-jobs/{training_job_id}/events", {
          params: { path: { training_job_id: trainingJobId }, query: { ...query, after } },
          ...init,
          headers: { accept: "application/json", ...init.headers },
        }),
      ) as Promise<Schemas["TrainingJobEventList"]>;
    });
  }

  /**
   * Yields the job's events live, until its terminal event (`training_ended` or
   * `training_failed`); a dropped stream is followed again from the last event seen. Each step
   * comes once: a job resumed after its worker died yields `training_started` again, with
   * `data.resumed_from_step` and `data.attempt`, and then only the steps not yet reported.
   */
  async *follow(
    trainingJobId: string,
    query: { after?: string } = {},
    options: RequestOptions = {},
  ): AsyncGenerator<TrainingJobEvent> {
    let after = query.after;
    for (;;) {
      const init = this.#core.init(options);
      const result = await this.#core.api.GET(
        "/v1/preview/training-jobs/{training_job_id}/events",
        {
          params: { path: { training_job_id: trainingJobId }, query: after ? { after } : {} },
          parseAs: "stream",
          ...init,
          headers: { accept: "text/event-stream", ...init.headers },
        },
      );
      if (!result.response.ok) unwrap(result);
      let ended = false;
      // The stream ends after the terminal event (read to its end, briefly: see sseJson).
      for await (const event of sseJson<TrainingJobEvent>(result.response, (e) =>
        terminalEventTypes.has(e.type),
      )) {
        yield event;
        after = event.id;
        ended = terminalEventTypes.has(event.type);
      }
      if (ended) return;
      if (options.signal?.aborted) return;
      await this.#core.sleep(reconnectDelayMs);
    }
  }
}
