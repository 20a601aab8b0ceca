/**
 * `@arbor/engine/model`: a model and its files (config, weights, safetensors, GGUF, tokenizer,
 * chat template), its forward pass, LoRA adapters, the shipped catalogue, base-model folders and
 * pulling them from the Hub, and the memory its weights take. Imports only the kernels.
 */
export { catalogModelDir, listCatalog } from "./catalog.ts";
export { type ChatFiles, type ChatMessage, PromptError } from "./chat.ts";
export { type ModelConfig, parseConfig } from "./config.ts";
export {
  type BaseModelFolder,
  checkModelFolder,
  type SkippedFolder,
  scanBaseModels,
} from "./folders.ts";
export { createKvCache, forwardBatch, releaseKvCache } from "./forward.ts";
export {
  exportGguf,
  exportLoraGguf,
  GGUF_OUTTYPES,
  type GgufOuttype,
  readGguf,
} from "./gguf.ts";
export {
  HubError,
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
  mergeAdapter,
} from "./lora.ts";
export { EngineMemoryError, type WeightStorage } from "./memory.ts";
export {
  type ArenaChoice,
  loadModel,
  loadServingModel,
  type Model,
  parameterCount,
  randomModel,
  readChatFiles,
  releaseModel,
  saveModel,
  type WeightChoice,
} from "./model.ts";
export {
  type DistributionDistance,
  distributionDistance,
  positionLogits,
  QUALITY_TEXT,
} from "./quality.ts";
export { deriveSeed, Rng, randomSeed } from "./rng.ts";
export { readSafetensors } from "./safetensors.ts";
export { heldSuffix } from "./text.ts";
export {
  callOpening,
  constrainedCall,
  parseToolCalls,
  sendableLength,
  type ToolCallFormat,
  toolCallFormat,
  toolCallStart,
} from "./tool-calls.ts";
