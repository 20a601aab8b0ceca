export {
  ADAPTER_FILES,
  CHECKPOINTS_PREFIX,
  type CheckpointFiles,
  modelFilesPrefix,
  OPTIMIZER_FILE,
  readCheckpointFiles,
  writeCheckpointFiles,
} from "./checkpoints.ts";
export {
  classifyAddress,
  datasetIdOf,
  type FetchTrainingDataOptions,
  fetchTrainingData,
  loadTrainingData,
  resolveDatasetUrl,
  TrainingDataError,
} from "./datasets/fetch.ts";
export {
  DatasetLineError,
  InvalidDatasetError,
  parseSftJsonl,
  type SftExample as DatasetExample,
  validateSftJsonl,
} from "./datasets/jsonl.ts";
export {
  EmbeddedWorker,
  type EmbeddedWorkerOptions,
  type WorkerHealth,
} from "./runner/embedded.ts";
export { dataDirIdentity, processIdentity, type WorkerIdentity } from "./runner/identity.ts";
export { catalogModels, sftExamplesLoader, type TrainingDataSettings } from "./runner/loaders.ts";
export {
  JobInputError,
  MAX_JOB_EXAMPLES,
  MAX_JOB_STEPS,
  MAX_JOB_TOKENS,
  TrainingWorker,
  type TrainingWorkerOptions,
} from "./runner/runner.ts";
export type { WorkerThreadSettings } from "./runner/thread.ts";
export { PAYLOADS_PREFIX, type SweepOptions, type SweepResult, sweepBlobs } from "./sweep.ts";
