export {
  ADAPTER_MAX_BYTES,
  type AdapterTar,
  adapterTrainsHead,
  checkpointAdapterTar,
  importAdapter,
  readAdapterTar,
  reprDigest,
} from "./adapters.ts";
export {
  ADAPTER_FILES,
  CHECKPOINTS_PREFIX,
  type CheckpointFiles,
  type ModelFilesUse,
  modelFilesPrefix,
  OPTIMIZER_FILE,
  readCheckpointFiles,
  withModelFiles,
  writeCheckpointFiles,
} from "./checkpoints.ts";
export {
  createDataset,
  DATASET_MAX_BYTES,
  datasetIdOf,
  datasetLines,
  datasetUrl,
  findDataset,
} from "./datasets/datasets.ts";
export {
  classifyAddress,
  type FetchTrainingDataOptions,
  fetchTrainingData,
  loadTrainingData,
} from "./datasets/fetch.ts";
export {
  DatasetLineError,
  InvalidDatasetError,
  type SftLine,
  sftExamples,
  validateSftJsonl,
} from "./datasets/jsonl.ts";
export { JobInputError, TrainingDataError } from "./errors.ts";
export {
  checkpointGguf,
  type GgufExport,
  type StoredExport,
  sweepExports,
} from "./exports.ts";
export {
  defaultLearningRate,
  enqueueRlJob,
  enqueueSftJob,
  MAX_JOB_EXAMPLES,
  MAX_JOB_STEPS,
  MAX_JOB_TOKENS,
  PAYLOADS_PREFIX,
  type RlJobSpec,
  rlJobSpec,
  rlStepConfig,
  type SftJobSpec,
  sftJobSpec,
  sftTrainingConfig,
} from "./jobs.ts";
export {
  EmbeddedWorker,
  type EmbeddedWorkerOptions,
  type WorkerHealth,
} from "./runner/embedded.ts";
export { dataDirIdentity, processIdentity, type WorkerIdentity } from "./runner/identity.ts";
export { baseModels, sftExamplesLoader, type TrainingDataSettings } from "./runner/loaders.ts";
export {
  type JobOutcome,
  type TrainingActivity,
  TrainingWorker,
  type TrainingWorkerOptions,
} from "./runner/runner.ts";
export type { WorkerThreadSettings } from "./runner/thread.ts";
export {
  freshAdapter,
  learnerFromState,
  type RunActivity,
  RunExecutor,
  type RunExecutorOptions,
  type SafePoint,
} from "./runs/execute.ts";
export {
  decodeBatch,
  type WireBatch,
  type WireLoss,
} from "./runs/token-matrix.ts";
export { type SweepOptions, type SweepResult, sweepBlobs } from "./sweep.ts";
