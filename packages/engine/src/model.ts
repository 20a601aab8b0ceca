import { mkdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { type ChatFiles, ChatFormat } from "./chat.ts";
import {
  configToJson,
  type GenerationConfig,
  type ModelConfig,
  parseConfig,
  parseGenerationConfig,
} from "./config.ts";
import { readSafetensorsFile, saveSafetensors, type TensorMap } from "./safetensors.ts";
import { ModelFileError, type Tokenizer } from "./tokenizer.ts";
import {
  countParameters,
  initWeights,
  type ModelWeights,
  weightsFromTensors,
  weightsToTensors,
} from "./weights.ts";

export interface Model {
  config: ModelConfig;
  weights: ModelWeights;
  tokenizer: Tokenizer;
  /** The tokenizer with the model's chat template and the ids that end a turn. */
  chat: ChatFormat;
  /** `generation_config.json`: sampling defaults for fields a request leaves out. */
  generation: GenerationConfig;
  rope: RopeTables;
  /** Bumped whenever weights change in place, so kernels can refresh cached copies. */
  version: number;
}

export interface RopeTables {
  cos: Float32Array;
  sin: Float32Array;
  half: number;
}

export function createModel(config: ModelConfig, weights: ModelWeights, files: ChatFiles): Model {
  const chat = new ChatFormat(files, config.eosTokenId);
  return {
    config,
    weights,
    tokenizer: chat.tokenizer,
    chat,
    generation: files.generation,
    rope: ropeTables(config),
    version: 0,
  };
}

/** cos/sin of position·θ^(-2i/d), HF Llama's rotate-half convention, [maxPositions, headDim/2],
 * with Llama 3.1's frequency scaling when the config has it. */
export function ropeTables(config: ModelConfig): RopeTables {
  const half = config.headDim / 2;
  const invFreq = Float64Array.from({ length: half }, (_, i) =>
    scaledFrequency(1 / config.ropeTheta ** ((2 * i) / config.headDim), config),
  );
  const cos = new Float32Array(config.maxPositions * half);
  const sin = new Float32Array(config.maxPositions * half);
  for (let p = 0; p < config.maxPositions; p++) {
    for (let i = 0; i < half; i++) {
      const angle = p * invFreq[i]!;
      cos[p * half + i] = Math.cos(angle);
      sin[p * half + i] = Math.sin(angle);
    }
  }
  return { cos, sin, half };
}

/** `rope_type: "llama3"`: low frequencies divided by `factor`, high ones kept, and a smooth
 * blend between (transformers' `_compute_llama3_parameters`). */
function scaledFrequency(invFreq: number, config: ModelConfig): number {
  const scaling = config.ropeScaling;
  if (!scaling) return invFreq;
  const { factor, lowFreqFactor, highFreqFactor, originalMaxPositions } = scaling;
  const lowFreqWavelen = originalMaxPositions / lowFreqFactor;
  const highFreqWavelen = originalMaxPositions / highFreqFactor;
  const wavelen = (2 * Math.PI) / invFreq;
  if (wavelen < highFreqWavelen) return invFreq;
  if (wavelen > lowFreqWavelen) return invFreq / factor;
  const smooth =
    (originalMaxPositions / wavelen - lowFreqFactor) / (highFreqFactor - lowFreqFactor);
  return (1 - smooth) * (invFreq / factor) + smooth * invFreq;
}

/**
 * Loads a Hugging Face model folder: `config.json`, `tokenizer.json` and `tokenizer_config.json`,
 * the chat template (`chat_template.jinja`, else `tokenizer_config.json`'s), the optional
 * `generation_config.json`, and the safetensors weights. A file that cannot be used is a
 * `ModelFileError` naming it.
 */
export async function loadModel(dir: string): Promise<Model> {
  let config: ModelConfig;
  try {
    config = parseConfig(await readJson(dir, "config.json"));
  } catch (err) {
    if (err instanceof ModelFileError) throw err;
    throw new ModelFileError(
      join(dir, "config.json"),
      (err as Error).message.replace(/^config\.json: /, ""),
    );
  }
  const files = await readChatFiles(dir);
  const tensors = await readWeights(dir);
  let weights: ModelWeights;
  try {
    weights = weightsFromTensors(config, tensors);
  } catch (err) {
    throw new ModelFileError(join(dir, "model.safetensors"), (err as Error).message);
  }
  return createModel(config, weights, files);
}

/** The folder's tokenizer, chat template and generation config. */
export async function readChatFiles(dir: string): Promise<ChatFiles> {
  const tokenizer = await readJson(dir, "tokenizer.json");
  const config = (await readJson(dir, "tokenizer_config.json", {})) ?? {};
  const jinjaFile = join(dir, "chat_template.jinja");
  let templateFile = jinjaFile;
  let template = await readFile(jinjaFile, "utf8").catch(() => undefined);
  if (template === undefined) {
    templateFile = join(dir, "tokenizer_config.json");
    const inline = config.chat_template;
    template =
      typeof inline === "string"
        ? inline
        : Array.isArray(inline)
          ? (inline as { name?: string; template?: string }[]).find((t) => t.name === "default")
              ?.template
          : undefined;
  }
  if (typeof template !== "string") {
    throw new ModelFileError(
      join(dir, "tokenizer_config.json"),
      "no chat_template (nor a chat_template.jinja beside it)",
    );
  }
  const generation = parseGenerationConfig(
    (await readJson(dir, "generation_config.json", {})) ?? {},
  );
  return {
    tokenizer: { tokenizer, config },
    tokenizerFile: join(dir, "tokenizer.json"),
    template,
    templateFile,
    generation,
  };
}

async function readJson(
  dir: string,
  name: string,
  missing?: Record<string, unknown>,
): Promise<Record<string, unknown>> {
  const path = join(dir, name);
  let text: string;
  try {
    text = await readFile(path, "utf8");
  } catch (err) {
    if (missing && (err as NodeJS.ErrnoException).code === "ENOENT") return missing;
    throw new ModelFileError(path, (err as Error).message);
  }
  try {
    const value = JSON.parse(text) as unknown;
    if (typeof value !== "object" || value === null || Array.isArray(value)) {
      throw new Error("not a JSON object");
    }
    return value as Record<string, unknown>;
  } catch (err) {
    throw new ModelFileError(path, `not valid JSON (${(err as Error).message})`);
  }
}

/** model.safetensors, or the shards listed in model.safetensors.index.json. */
async function readWeights(dir: string): Promise<TensorMap> {
  let index: { weight_map?: Record<string, string> } | null = null;
  try {
    index = JSON.parse(await readFile(join(dir, "model.safetensors.index.json"), "utf8"));
  } catch {
    index = null;
  }
  const files = index?.weight_map
    ? [...new Set(Object.values(index.weight_map))]
    : ["model.safetensors"];
  const tensors: TensorMap = new Map();
  for (const file of files) {
    const path = join(dir, file);
    try {
      await readSafetensorsFile(path, (name, tensor) => tensors.set(name, tensor));
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === "ENOENT") {
        throw new ModelFileError(path, "missing (the model's weights)");
      }
      throw err instanceof ModelFileError
        ? err
        : new ModelFileError(path, (err as Error).message.replace(`${path}: `, ""));
    }
  }
  return tensors;
}

/** Writes a Hugging Face folder that `loadModel` (and `transformers`) read back; the weights in
 * F32, or BF16 as most models are published. */
export async function saveModel(
  model: Model,
  dir: string,
  options: { dtype?: "F32" | "BF16" } = {},
): Promise<void> {
  await mkdir(dir, { recursive: true });
  const json = (value: unknown) => `${JSON.stringify(value, null, 2)}\n`;
  await writeFile(join(dir, "config.json"), json(configToJson(model.config)));
  await writeFile(join(dir, "tokenizer.json"), JSON.stringify(model.tokenizer.files.tokenizer));
  await writeFile(
    join(dir, "tokenizer_config.json"),
    json({ ...model.tokenizer.files.config, chat_template: model.chat.template.source }),
  );
  if (Object.keys(model.generation.raw).length > 0) {
    await writeFile(join(dir, "generation_config.json"), json(model.generation.raw));
  }
  await writeFile(
    join(dir, "model.safetensors"),
    saveSafetensors(
      weightsToTensors(model.config, model.weights),
      { format: "pt" },
      options.dtype ?? "F32",
    ),
  );
}

export function parameterCount(model: Model): number {
  return countParameters(model.config, model.weights);
}

/** Rotates one head vector in place (rotate-half RoPE) at a position. */
export function applyRope(
  x: Float32Array,
  offset: number,
  position: number,
  rope: RopeTables,
  sign: 1 | -1 = 1,
): void {
  const { half, cos, sin } = rope;
  const t = position * half;
  for (let i = 0; i < half; i++) {
    const c = cos[t + i]!;
    const s = sign * sin[t + i]!;
    const a = x[offset + i]!;
    const b = x[offset + i + half]!;
    x[offset + i] = a * c - b * s;
    x[offset + i + half] = b * c + a * s;
  }
}

/**
 * A model of a real family's shape with random weights (GPT-2-style init) and the given
 * tokenizer and chat template: what benches and tests use in place of published weights, which
 * are not downloaded here. `config` is a `config.json` (its `vocab_size` defaults to the
 * tokenizer's).
 */
export function randomModel(config: Record<string, unknown>, files: ChatFiles, seed = 0): Model {
  const chat = new ChatFormat(files, []);
  const parsed = parseConfig({ vocab_size: chat.tokenizer.vocabSize, ...config });
  return createModel(parsed, initWeights(parsed, seed), files);
}
