/**
 * `@arbor/engine/model`: a model and its files (config, weights, safetensors, GGUF, tokenizer,
 * chat template), its forward pass, LoRA adapters, the shipped catalogue, base-model folders and
 * pulling them from the Hub, and the memory its weights take. Imports only the kernels.
 */
export { type CatalogEntry, catalogModelDir, listCatalog } from "./catalog.ts";
export { type ChatFiles, type ChatMessage, PromptError, type RenderOptions } from "./chat.ts";
export { type ModelConfig, parseConfig } from "./config.ts";
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
  loraParameters,
  MAX_ADAPTER_WEIGHT,
  MAX_ALPHA,
  MAX_RANK,
  mergeAdapter,
} from "./lora.ts";
export { EngineMemoryError, type WeightStorage } from "./memory.ts";
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
export { deriveSeed, Rng, randomSeed } from "./rng.ts";
export { readSafetensors } from "./safetensors.ts";
export { heldSuffix } from "./text.ts";
export { ModelFileError } from "./tokenizer.ts";
export {
  constrainedCall,
  parseToolCalls,
  sendableLength,
  type ToolCallFormat,
  toolCallFormat,
  toolCallStart,
} from "./tool-calls.ts";
