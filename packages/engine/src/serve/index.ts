/**
 * `@arbor/engine/serve`: generation (continuous batching, sampling, JSON constraints), on the
 * calling thread (`Engine`) or on a thread of its own (`EngineThread`), and prompts encoded
 * off the caller's thread. Imports the model and the kernels, never training.
 */
export {
  type ChatPromptOptions,
  Engine,
  type GenerationEvent,
  type TokenLogprob,
  type ToolCallConstraint,
} from "./engine.ts";
export { EngineThread, type ThreadGenerateRequest } from "./engine-thread.ts";
export { type JsonSchema, parseJsonSchema, UnsupportedSchemaError } from "./json-constraint.ts";
export { ContextLengthError } from "./prompt-encoder.ts";
