export { batchFromChats } from "./batch.ts";
export { type CatalogEntry, catalogModelDir, listCatalog } from "./catalog.ts";
export {
  CHATML_TEMPLATE,
  type ChatMessage,
  type ChatRole,
  END_OF_TEXT,
  IM_END,
  IM_START,
  type RenderedChat,
  renderChat,
  type ToolCall,
} from "./chat.ts";
export { configToJson, type ModelConfig, parseConfig } from "./config.ts";
export {
  type Completion,
  type CompletionChoice,
  Engine,
  type FinishReason,
  type GenerateRequest,
  type GenerationEvent,
  type ResponseFormat,
  type TokenLogprob,
} from "./engine.ts";
export {
  EngineThread,
  type EngineThreadInfo,
  type EngineThreadStats,
  type ThreadGenerateRequest,
} from "./engine-thread.ts";
export { createKvCache, type ForwardItem, forwardBatch, type KvCache } from "./forward.ts";
export {
  exportGguf,
  type GgufFile,
  type GgufTensorInfo,
  ggufBytes,
  permuteForGguf,
  readGguf,
} from "./gguf.ts";
export {
  JsonConstraint,
  type JsonSchema,
  parseJsonSchema,
  UnsupportedSchemaError,
} from "./json-constraint.ts";
export { jsKernels, type Kernels } from "./kernels.ts";
export {
  adapterConfigJson,
  adapterFromFiles,
  adapterToFiles,
  addLoraRows,
  checkAdapter,
  cloneAdapter,
  createLoraAdapter,
  type LinearHooks,
  type LinearKey,
  LORA_TARGETS,
  type LoraAdapter,
  type LoraConfig,
  type LoraModule,
  type LoraParameter,
  type LoraTarget,
  loadAdapter,
  loraHooks,
  loraParameterCount,
  loraParameters,
  saveAdapter,
  zerosLikeAdapter,
} from "./lora.ts";
export { LoraTrainer, type LoraTrainerOptions } from "./lora-train.ts";
export {
  createModel,
  loadModel,
  type Model,
  parameterCount,
  saveModel,
  tokenizerConfig,
} from "./model.ts";
export {
  AdamW,
  type AdamWOptions,
  clipGradients,
  type LrSchedule,
  learningRate,
  type ScheduleKind,
  type StepResult,
  Trainer,
  type TrainerOptions,
} from "./optim.ts";
export {
  ContextLengthError,
  PromptEncoder,
  PromptError,
  promptBytes,
} from "./prompt-encoder.ts";
export {
  type RlConfig,
  type RlLoss,
  type RlStepMetrics,
  type Trajectory,
  type TrajectoryGroup,
  trainRlStep,
} from "./rl.ts";
export { deriveSeed, Rng } from "./rng.ts";
export {
  type NamedTensor,
  readSafetensors,
  saveSafetensors,
  type TensorMap,
} from "./safetensors.ts";
export {
  microBatches,
  planSft,
  type SftConfig,
  type SftExample,
  type SftOptions,
  type SftPlan,
  type SftProgress,
  type SftResult,
  type SftStepMetrics,
  trainSft,
} from "./sft.ts";
export { type AddedToken, Tokenizer, trainBpe } from "./tokenizer.ts";
export {
  type LossOptions,
  type LossResult,
  lossAndGradients,
  type TrainBatch,
} from "./train.ts";
export {
  packBatch,
  type TokenizedChat,
  TrainingInputError,
  toChatMessage,
  tokenizeChat,
  type WeightedSequence,
  withTools,
} from "./training-data.ts";
export {
  createWasmKernels,
  defaultKernels,
  relaxedSimdSupported,
  WasmKernels,
} from "./wasm/kernels.ts";
export {
  countParameters,
  initWeights,
  type LayerWeights,
  type ModelWeights,
  parameters,
  zerosLike,
} from "./weights.ts";
