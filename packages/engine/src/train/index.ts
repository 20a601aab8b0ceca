/**
 * `@arbor/engine/train`: the backward pass and its losses, AdamW, LoRA training, SFT, DPO and RL,
 * their input checks, and the memory a training pass needs. Imports the model and the kernels,
 * never serving.
 */
export {
  type DpoConfig,
  type DpoPair,
  type DpoPlan,
  type DpoStepMetrics,
  dpoMicroBatchBudget,
  planDpo,
  trainDpo,
} from "./dpo.ts";
export { LoraTrainer } from "./lora-train.ts";
export { Trainer } from "./optim.ts";
export {
  type RlConfig,
  type TrajectoryGroup,
  trainRlStep,
} from "./rl.ts";
export {
  evaluateSft,
  planSft,
  type SftConfig,
  type SftEvalMetrics,
  type SftExample,
  type SftSequence,
  sftSequences,
  trainSft,
} from "./sft.ts";
export {
  microBatchBudget,
  trainingMemory,
} from "./train-memory.ts";
export { TrainingInputError } from "./training-data.ts";
