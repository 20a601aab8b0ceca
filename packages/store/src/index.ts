export {
  assertBlobKey,
  type BlobBody,
  type BlobStore,
  FsBlobStore,
  WRITER_TAG,
  writerGone,
} from "./blobs.ts";
export type {
  Call,
  CallBatchItem,
  CallBatchResult,
  CallEndInput,
  CallFilter,
  CallStartInput,
  CallsRepo,
  CallUsageResult,
  ModelUsage,
} from "./calls.ts";
export type { Clock, Json, JsonInput, Page, PageOptions } from "./common.ts";
export { canonical } from "./common.ts";
export type { Dataset, DatasetsRepo } from "./datasets.ts";
export {
  assertName,
  ConflictError,
  DomainError,
  type DomainErrorKind,
  type DomainErrorOptions,
  ForbiddenError,
  InvalidInputError,
  isUniqueViolation,
  LimitExceededError,
  NAME_PATTERN,
  NotFoundError,
  quote,
  UnavailableError,
} from "./errors.ts";
export type { CreateFineTuningJob, FineTuningJob, FineTuningJobsRepo } from "./fine-tuning.ts";
export {
  API_KEY_PREFIX,
  type ApiKey,
  type ApiKeysRepo,
  type EntitiesRepo,
  type Entity,
  type KeyIdentity,
  type Membership,
  type User,
  type UsersRepo,
} from "./identity.ts";
export { unixSeconds, uuidv7 } from "./ids.ts";
export {
  type EnqueueInput,
  type JobEvent,
  type JobProgress,
  type JobStatus,
  type JobsRepo,
  type JobType,
  type ReclaimResult,
  TERMINAL_STATUSES,
  type TrainingJob,
} from "./jobs.ts";
export { MemoryBlobStore } from "./memory-blobs.ts";
export { MIGRATIONS, type Migration, migrate } from "./migrations.ts";
export type { Checkpoint, CreateModelInput, Model, ModelsRepo } from "./models.ts";
export {
  BlobChangedError,
  checkFilesLeftInDataDir,
  PgBlobStore,
} from "./pg-blobs.ts";
export { isoDate, type Price, type PricesRepo, type SetPriceInput } from "./prices.ts";
export {
  MemoryRateLimits,
  type NamedLimit,
  openRateLimits,
  PgRateLimits,
  type RateLimitBackend,
  type RateLimitState,
  RedisRateLimits,
  type RedisRateLimitsOptions,
  type TakeRequest,
  type TakeResult,
} from "./rate-limits.ts";
export {
  type Dialect,
  PostgresSql,
  type Sql,
  SqliteSql,
  type SqlValue,
  type TransactionOptions,
} from "./sql.ts";
export {
  BLOB_BACKENDS,
  type BlobBackend,
  openStore,
  type PingResult,
  type Store,
  type StoreOptions,
} from "./store.ts";
export {
  MAX_UNFINISHED_OPERATIONS,
  type OperationKind,
  type OperationOutcome,
  type RunStatus,
  type TrainingOperation,
  type TrainingRun,
  type TrainingState,
} from "./training-runs.ts";
export { MAX_USAGE_MODELS, type UsageRow, usageRowsOf } from "./usage-rows.ts";
