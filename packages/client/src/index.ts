export type { components, operations, paths } from "@arbor/spec/schema";
export {
  type ArborClient,
  type ArborClientOptions,
  type ChatCompletion,
  type ChatCompletionChunk,
  type ChatCompletionRequest,
  type Checkpoint,
  type CheckpointContent,
  type CheckpointFormat,
  createArborClient,
  type TrainingJobEvent,
  type TrainingJobEventList,
} from "./client.ts";
export {
  APIConnectionError,
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
export { isRetryableRequest, retryDelayMs, shouldRetryResponse } from "./retries.ts";
