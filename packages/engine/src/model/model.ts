import { mkdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import type { Kernels, PackedWeight, WeightDtype } from "../kernels/types.ts";
import { createWasmKernels, packSliceRows, type WasmKernels } from "../kernels/wasm.ts";
import { isWeightSource, type Weight, weightRows } from "../kernels/weight.ts";
import { type ChatFiles, ChatFormat } from "./chat.ts";
import {
  configToJson,
  type GenerationConfig,
  type ModelConfig,
  parseConfig,
  parseGenerationConfig,
} from "./config.ts";
import { EngineMemoryError, packedWeightBytes, type WeightStorage } from "./memory.ts";
import { openSafetensors, type SafetensorsEntry, saveSafetensors } from "./safetensors.ts";
import { ModelFileError, type Tokenizer } from "./tokenizer.ts";
import {
  countParameters,
  hfName,
  initWeights,
  type LayerKey,
  type LayerWeights,
  layerKeysOf,
  layerShape,
  linearKeys,
  type ModelWeights,
  matrixNames,
  parameters,
  weightsToTensors,
} from "./weights.ts";

/** A model; `W` is how its Linear weights are held: `Float32Array` (plain arrays, which kernels
 * pack on first use, and which full fine-tuning updates) or `Weight` (possibly packed in a
 * kernels' arena as their only copy, see `loadModel`'s `kernels`). */
export interface Model<W extends Weight = Weight> {
  config: ModelConfig;
  weights: ModelWeights<W>;
  tokenizer: Tokenizer;
  /** The tokenizer with the model's chat template and the ids that end a turn. */
  chat: ChatFormat;
  /** `generation_config.json`: sampling defaults for fields a request leaves out. */
  generation: GenerationConfig;
  rope: RopeTables;
  /** Bumped whenever weights change in place, so kernels can refresh cached copies. */
  version: number;
  /** Where the weights live: plain arrays, or packed in kernels (F32 or BF16) as the only copy. */
  storage: WeightStorage;
}

export interface RopeTables {
  cos: Float32Array;
  sin: Float32Array;
  half: number;
}

export function createModel<W extends Weight>(
  config: ModelConfig,
  weights: ModelWeights<W>,
  files: ChatFiles,
  storage: WeightStorage = "plain",
): Model<W> {
  const chat = new ChatFormat(files, config.eosTokenId);
  return {
    storage,
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

/** Where `loadModel` keeps the weights. */
export interface LoadOptions {
  /**
   * Kernels that keep every Linear weight and the embeddings packed in their memory (the WASM
   * arena) as the model's only copy, read from the files a block of rows at a time: the
   * model then costs its packed size, and export and merging unpack one tensor at a time.
   * Without kernels (or with kernels that cannot pack, `jsKernels`) the weights are plain F32
   * arrays, which any kernels pack on first use (a second copy) and full fine-tuning updates.
   */
  kernels?: Kernels;
  /**
   * How packed weights hold their numbers: F32, BF16 widened inside the kernels (F32 and F16
   * files are rounded), q8 (int8 blocks quantized as they are read, ADR 61), or `auto`: BF16
   * when every weight matrix in the files is BF16 (exact, half the memory), F32 otherwise (never
   * rounds; never q8). Default F32.
   */
  weights?: WeightChoice;
  /**
   * Bytes of the kernels' memory to keep free beside the packed weights (for serving: see
   * `servingRoom`): a model that leaves less is refused before any weight is read. Default 0.
   */
  room?: (config: ModelConfig) => number;
}

/** `LoadOptions.weights`. */
export type WeightChoice = WeightDtype | "auto";

/**
 * Loads a Hugging Face model folder: `config.json`, `tokenizer.json` and `tokenizer_config.json`,
 * the chat template (`chat_template.jinja`, else `tokenizer_config.json`'s), the optional
 * `generation_config.json`, and the safetensors weights (one file or shards; F32, F16 or BF16),
 * read tensor by tensor. A file that cannot be used is a `ModelFileError` naming it; weights the
 * kernels cannot hold (with `room` beside them) an `EngineMemoryError`, before any is read.
 */
export async function loadModel(dir: string): Promise<Model<Float32Array>>;
export async function loadModel(dir: string, options: LoadOptions): Promise<Model>;
export async function loadModel(dir: string, options: LoadOptions = {}): Promise<Model> {
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
  const kernels = options.kernels?.packWeight ? options.kernels : null;
  const choice = options.weights ?? "f32";
  /** Refuses, before any weight is read, weights that cannot fit the kernels' memory. */
  const fits = (dtype: WeightDtype) => {
    const need = packedWeightBytes(config, dtype);
    const room = options.room?.(config) ?? 0;
    if (kernels && need + room > kernels.memoryLimit) {
      throw new EngineMemoryError(
        `${join(dir, "config.json")}: too large for the engine: its weights take ${(need / 1e9).toFixed(2)} GB packed in ${dtype.toUpperCase()}${room ? `, with ${(room / 1e9).toFixed(2)} GB beside them to serve,` : ","} and the engine's memory holds ${(kernels.memoryLimit / 1e9).toFixed(2)} GB`,
        need + room,
        kernels.memoryLimit,
      );
    }
  };
  // A choice made already is checked before the files are even opened.
  if (choice !== "auto") fits(choice);
  const { weights, storage } = await readWeights(
    dir,
    config,
    kernels
      ? {
          choose: (allBf16) => {
            const dtype = choice === "auto" ? (allBf16 ? "bf16" : "f32") : choice;
            fits(dtype);
            return dtype;
          },
          pack: (rows, cols, dtype) => kernels.packWeight!(rows, cols, dtype),
        }
      : null,
  );
  return createModel(config, weights, files, storage);
}

/** Arena a served model needs beside its packed weights for activations and scratch. */
const SERVING_SCRATCH = 256 << 20;
/** Tokens of KV cache (all sequences together) that serving plans room for in the arena, where
 * the caches of the running sequences live. */
export const SERVING_KV_TOKENS = 8192;

/**
 * Arena a served model needs beside its packed weights: scratch, and `SERVING_KV_TOKENS`
 * tokens of KV cache (F32 keys and values of every layer).
 */
export function servingRoom(config: ModelConfig): number {
  const kvPerToken = config.numLayers * 2 * config.numKvHeads * config.headDim * 4;
  return SERVING_SCRATCH + SERVING_KV_TOKENS * kvPerToken;
}

/** Where `loadServingModel` puts a model: wasm32 while it fits (faster), or one forced. */
export type ArenaChoice = "auto" | "wasm32" | "memory64";

/**
 * Loads a folder to serve it, into kernels of its own: packed in a wasm32 arena when the weights
 * and `servingRoom` fit its 4 GiB, else in a Memory64 one (a model too large is refused before
 * any weight is read, so trying costs nothing).
 */
export async function loadServingModel(
  dir: string,
  options: { threads: number; weights: WeightChoice; arena?: ArenaChoice },
): Promise<{ kernels: WasmKernels; model: Model }> {
  const arena = options.arena ?? "auto";
  const load = async (memory64: boolean) => {
    const kernels = createWasmKernels("auto", { threads: options.threads, memory64 });
    try {
      const model = await loadModel(dir, {
        kernels,
        weights: options.weights,
        room: servingRoom,
      });
      return { kernels, model };
    } catch (err) {
      await kernels.close();
      throw err;
    }
  };
  if (arena !== "auto") return load(arena === "memory64");
  return load(false).catch((err: unknown) => {
    if (err instanceof EngineMemoryError) return load(true);
    throw err;
  });
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

/**
 * The weights the config needs, from model.safetensors or the shards listed in
 * model.safetensors.index.json, a tensor at a time: with `pack`, each matrix is packed a block
 * of rows at a time as it is read (never whole in F32); without, each becomes a plain array.
 */
async function readWeights(
  dir: string,
  config: ModelConfig,
  packing: {
    /** The dtype to pack in, told whether every weight matrix in the files is BF16. */
    choose(allBf16: boolean): WeightDtype;
    pack(rows: number, cols: number, dtype: WeightDtype): PackedWeight;
  } | null,
): Promise<{ weights: ModelWeights; storage: WeightStorage }> {
  let index: { weight_map?: Record<string, string> } | null = null;
  try {
    index = JSON.parse(await readFile(join(dir, "model.safetensors.index.json"), "utf8"));
  } catch {
    index = null;
  }
  const files = index?.weight_map
    ? [...new Set(Object.values(index.weight_map))]
    : ["model.safetensors"];
  const opened: { close(): Promise<void> }[] = [];
  const entries = new Map<string, { entry: SafetensorsEntry; path: string }>();
  const fileError = (path: string, err: unknown) => {
    if ((err as NodeJS.ErrnoException).code === "ENOENT") {
      return new ModelFileError(path, "missing (the model's weights)");
    }
    return err instanceof ModelFileError
      ? err
      : new ModelFileError(path, (err as Error).message.replace(`${path}: `, ""));
  };
  try {
    for (const file of files) {
      const path = join(dir, file);
      try {
        const shard = await openSafetensors(path);
        opened.push(shard);
        for (const [name, entry] of shard.tensors) entries.set(name, { entry, path });
      } catch (err) {
        throw fileError(path, err);
      }
    }
    const find = (name: string, shape: number[]) => {
      const found = entries.get(name);
      if (!found) {
        throw new ModelFileError(join(dir, "model.safetensors"), `model: missing tensor ${name}`);
      }
      if (found.entry.shape.join(",") !== shape.join(",")) {
        throw new ModelFileError(
          found.path,
          `model: ${name} has shape [${found.entry.shape}], expected [${shape}]`,
        );
      }
      return found;
    };
    const plain = async (name: string, shape: number[]): Promise<Float32Array> => {
      const { entry, path } = find(name, shape);
      return entry.read(0, shape[0]!).catch((err) => {
        throw fileError(path, err);
      });
    };
    const dtype = packing?.choose(
      matrixNames(config).every((n) => entries.get(n)?.entry.dtype === "BF16"),
    );
    const matrix = async (name: string, shape: number[]): Promise<Weight> => {
      if (!packing || !dtype) return plain(name, shape);
      const { entry, path } = find(name, shape);
      const [rows, cols] = shape as [number, number];
      const weight = packing.pack(rows, cols, dtype);
      const step = packSliceRows(cols);
      try {
        for (let r0 = 0; r0 < rows; r0 += step) {
          weight.writeRows(r0, await entry.read(r0, Math.min(rows, r0 + step)));
        }
      } catch (err) {
        throw fileError(path, err);
      }
      return weight;
    };
    const layers: LayerWeights[] = [];
    for (let i = 0; i < config.numLayers; i++) {
      const layer = {} as Record<LayerKey, Weight>;
      for (const key of layerKeysOf(config)) {
        const shape = layerShape(config, key);
        layer[key] =
          shape.length === 2
            ? await matrix(hfName(i, key), shape)
            : await plain(hfName(i, key), shape);
      }
      layers.push(layer as unknown as LayerWeights);
    }
    const vd = [config.vocabSize, config.hiddenSize];
    const embed = await matrix("model.embed_tokens.weight", vd);
    // Tied: the embeddings are the output head (a stored lm_head is a copy of them, not read).
    // Untied: the head must be there; falling back to the embeddings would answer wrongly.
    const lmHead = config.tieWordEmbeddings ? null : await matrix("lm_head.weight", vd);
    const norm = await plain("model.norm.weight", [config.hiddenSize]);
    return { weights: { embed, layers, norm, lmHead }, storage: dtype ?? "plain" };
  } finally {
    for (const shard of opened) await shard.close();
  }
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

/**
 * The model with its Linear weights and embeddings packed in `kernels` as their only copy (as
 * `loadModel(dir, { kernels, weights })` loads them), a tensor at a time; norms and biases are
 * shared with `model`. For models built in memory (`randomModel`): tests and benches.
 */
export function packModel(model: Model, kernels: Kernels, dtype: WeightDtype = "f32"): Model {
  if (!kernels.packWeight) throw new Error(`kernels ${kernels.name} cannot keep packed weights`);
  const { config, weights } = model;
  const pack = (w: Weight, rows: number, cols: number): Weight => {
    const packed = kernels.packWeight!(rows, cols, dtype);
    const step = packSliceRows(cols);
    for (let r0 = 0; r0 < rows; r0 += step) {
      packed.writeRows(r0, weightRows(w, cols, r0, Math.min(rows, r0 + step)));
    }
    return packed;
  };
  const layers = weights.layers.map((layer) => {
    const out = { ...layer };
    for (const key of linearKeys) {
      const [rows, cols] = layerShape(config, key) as [number, number];
      out[key] = pack(layer[key], rows, cols);
    }
    return out;
  });
  const [V, D] = [config.vocabSize, config.hiddenSize];
  return {
    ...model,
    weights: {
      embed: pack(weights.embed, V, D),
      layers,
      norm: weights.norm,
      lmHead: weights.lmHead ? pack(weights.lmHead, V, D) : null,
    },
    storage: dtype,
  };
}

/** Frees the memory of a model's packed weights now; the model must not be used after. */
export function releaseModel(model: Model): void {
  for (const p of parameters(model.config, model.weights)) {
    if (isWeightSource(p.data) && "release" in p.data) (p.data as PackedWeight).release();
  }
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
export function randomModel(
  config: Record<string, unknown>,
  files: ChatFiles,
  seed = 0,
): Model<Float32Array> {
  const chat = new ChatFormat(files, []);
  const parsed = parseConfig({ vocab_size: chat.tokenizer.vocabSize, ...config });
  return createModel(parsed, initWeights(parsed, seed), files);
}
