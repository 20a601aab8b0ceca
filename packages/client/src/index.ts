export {
  type ArborClient,
  type ArborClientOptions,
  createArborClient,
  Health,
  type Resources,
} from "./client.ts";
export {
  DEFAULT_MAX_RETRIES,
  DEFAULT_TIMEOUT_MS,
  type ListBody,
  type Page,
  PagePromise,
  type RequestOptions,
} from "./core.ts";
export {
  APIConnectionError,
  APIConnectionTimeoutError,
  APIError,
  APIUserAbortError,
  ArborError,
  AuthenticationError,
  BadRequestError,
  ConflictError,
  type FetchResult,
  InternalServerError,
  NotFoundError,
  NotImplementedError,
  PayloadTooLargeError,
  PermissionDeniedError,
  RateLimitError,
  UnprocessableEntityError,
  unwrap,
} from "./errors.ts";
export type { components, operations, paths } from "./generated/schema.ts";
export { Calls } from "./resources/calls.ts";
export {
  Chat,
  type ChatCompletion,
  type ChatCompletionChunk,
  type ChatCompletionCreateParams,
  type ChatCompletionCreateParamsNonStreaming,
  type ChatCompletionCreateParamsStreaming,
  Completions,
  type ModelEntry,
  Models,
  Stream,
} from "./resources/inference.ts";
export {
  BaseModels,
  type Checkpoint,
  type CheckpointContent,
  type CheckpointFormat,
  Checkpoints,
  type Dataset,
  type DatasetInput,
  type DatasetLine,
  Datasets,
  Events,
  Jobs,
  type Model,
  type PullBaseModelRequest,
  type PulledBaseModel,
  Runs,
  type SftExample,
  Training,
  type TrainingJob,
  type TrainingJobEvent,
  TrainingModels,
  type TrainingOperationProgress,
  type TrainingRun,
} from "./resources/training.ts";
export { isRetryableRequest, retryDelayMs, shouldRetryResponse } from "./retries.ts";
export { VERSION } from "./version.ts";
