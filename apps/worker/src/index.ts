export {
  ADAPTER_FILES,
  type CheckpointFiles,
  OPTIMIZER_FILE,
  readCheckpointFiles,
  writeCheckpointFiles,
} from "./checkpoints.ts";
export { JobInputError, TrainingWorker, type TrainingWorkerOptions } from "./runner.ts";
