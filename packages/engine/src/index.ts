/**
 * The engine's public surface: what the server, the training package, the benches and the
 * contract tests use. Everything else is the engine's own (its tests import modules directly).
 */
export { type CatalogEntry, catalogModelDir, listCatalog } from "./catalog.ts";
export { type ChatFiles, type ChatMessage, PromptError } from "./chat.ts";
export { type ModelConfig, parseConfig } from "./config.ts";
export {
  Engine,
  type GenerationEvent,
  type TokenLogprob,
} from "./engine.ts";
export { EngineThread, type ThreadGenerateRequest } from "./engine-thread.ts";
export {
  type BaseModelFolder,
  checkModelFolder,
  type FolderCheckOptions,
  type SkippedFolder,
  scanBaseModels,
} from "./folders.ts";
export { createKvCache, forwardBatch, releaseKvCache } from "./forward.ts";
export { exportGguf, exportLoraGguf, readGguf } from "./gguf.ts";
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
} from "./hub.ts";
export {
  type JsonSchema,
  parseJsonSchema,
  UnsupportedSchemaError,
} from "./json-constraint.ts";
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
} from "./lora.ts";
export { LoraTrainer } from "./lora-train.ts";
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
} from "./model.ts";
export { Trainer } from "./optim.ts";
export { ContextLengthError } from "./prompt-encoder.ts";
export {
  type ImportanceSamplingLevel,
  type RlConfig,
  type RlLoss,
  type TrajectoryGroup,
  trainRlStep,
} from "./rl.ts";
export { deriveSeed, Rng, randomSeed } from "./rng.ts";
export { readSafetensors } from "./safetensors.ts";
export { planSft, type SftConfig, type SftExample, trainSft } from "./sft.ts";
export { ModelFileError } from "./tokenizer.ts";
export {
  EngineMemoryError,
  microBatchBudget,
  rowsThatFit,
  type TrainingMemory,
  trainingMemory,
  type WeightStorage,
} from "./train-memory.ts";
export { TrainingInputError } from "./training-data.ts";
