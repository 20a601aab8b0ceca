/**
 * The engine's public surface: what the server, the training package, the benches and the
 * contract tests use. Everything else is the engine's own (its tests import modules directly).
 */

export { jsKernels } from "./kernels/js.ts";
export type { Kernels, WeightDtype } from "./kernels/types.ts";
export {
  ARENA_LIMIT,
  ARENA_LIMIT_64,
  createWasmKernels,
  memory64Limit,
  packSliceRows,
  type WasmKernels,
} from "./kernels/wasm.ts";
export { type CatalogEntry, catalogModelDir, listCatalog } from "./model/catalog.ts";
export { type ChatFiles, type ChatMessage, PromptError } from "./model/chat.ts";
export { type ModelConfig, parseConfig } from "./model/config.ts";
export {
  type BaseModelFolder,
  checkModelFolder,
  type FolderCheckOptions,
  type SkippedFolder,
  scanBaseModels,
} from "./model/folders.ts";
export { createKvCache, forwardBatch, releaseKvCache } from "./model/forward.ts";
export { exportGguf, exportLoraGguf, readGguf } from "./model/gguf.ts";
export {
  DEFAULT_HUB_ENDPOINT,
  type HubAccess,
  HubError,
  type HubErrorKind,
  PULL_MANIFEST,
  type PullEvent,
  type PulledFile,
  type PullManifest,
  type PullOptions,
  type PullResult,
  parseRepoArgument,
  pullModel,
} from "./model/hub.ts";
export {
  AdapterError,
  adapterFromFiles,
  adapterToFiles,
  adapterWeightProblem,
  createLoraAdapter,
  HEAD_TARGET,
  LORA_TARGETS,
  type LoraAdapter,
  type LoraConfig,
  loraParameterCount,
  MAX_ADAPTER_WEIGHT,
  MAX_ALPHA,
  MAX_RANK,
  mergeAdapter,
} from "./model/lora.ts";
export {
  type ArenaChoice,
  type LoadOptions,
  loadModel,
  loadServingModel,
  type Model,
  packModel,
  parameterCount,
  randomModel,
  readChatFiles,
  releaseModel,
  saveModel,
  type WeightChoice,
} from "./model/model.ts";
export { deriveSeed, Rng, randomSeed } from "./model/rng.ts";
export { readSafetensors } from "./model/safetensors.ts";
export { ModelFileError } from "./model/tokenizer.ts";
export {
  Engine,
  type GenerationEvent,
  type TokenLogprob,
} from "./serve/engine.ts";
export { EngineThread, type ThreadGenerateRequest } from "./serve/engine-thread.ts";
export {
  type JsonSchema,
  parseJsonSchema,
  UnsupportedSchemaError,
} from "./serve/json-constraint.ts";
export { ContextLengthError } from "./serve/prompt-encoder.ts";
export { LoraTrainer } from "./train/lora-train.ts";
export { Trainer } from "./train/optim.ts";
export {
  type ImportanceSamplingLevel,
  type RlConfig,
  type RlLoss,
  type TrajectoryGroup,
  trainRlStep,
} from "./train/rl.ts";
export { planSft, type SftConfig, type SftExample, trainSft } from "./train/sft.ts";
export { EngineMemoryError, type WeightStorage } from "./model/memory.ts";
export {
  microBatchBudget,
  rowsThatFit,
  type TrainingMemory,
  trainingMemory,
} from "./train/train-memory.ts";
export { TrainingInputError } from "./train/training-data.ts";
