export {
  ADAPTER_FILES,
  type CheckpointFiles,
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
} from "./data/fetch.ts";
export {
  DatasetLineError,
  InvalidDatasetError,
  parseSftJsonl,
  type SftExample as DatasetExample,
  validateSftJsonl,
} from "./data/jsonl.ts";
export { EmbeddedWorker } from "./embedded.ts";
export { catalogModels, sftExamplesLoader, type TrainingDataSettings } from "./loaders.ts";
export { JobInputError, TrainingWorker, type TrainingWorkerOptions } from "./runner.ts";
export { type WorkerSettings, workerSettingsFromEnv } from "./settings.ts";
export type { WorkerThreadSettings } from "./thread.ts";
