import { mkdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { CHATML_TEMPLATE, END_OF_TEXT } from "./chat.ts";
import { configToJson, type ModelConfig, parseConfig } from "./config.ts";
import { readSafetensors, saveSafetensors, type TensorMap } from "./safetensors.ts";
import { Tokenizer } from "./tokenizer.ts";
import {
  countParameters,
  type ModelWeights,
  weightsFromTensors,
  weightsToTensors,
} from "./weights.ts";

export interface Model {
  config: ModelConfig;
  weights: ModelWeights;
  tokenizer: Tokenizer;
  rope: RopeTables;
  /** Bumped whenever weights change in place, so kernels can refresh cached copies. */
  version: number;
}

export interface RopeTables {
  cos: Float32Array;
  sin: Float32Array;
  half: number;
}

export function createModel(
  config: ModelConfig,
  weights: ModelWeights,
  tokenizer: Tokenizer,
): Model {
  return { config, weights, tokenizer, rope: ropeTables(config), version: 0 };
}

/** cos/sin of position·θ^(-2i/d), HF Llama's rotate-half convention, [maxPositions, headDim/2]. */
export function ropeTables(config: ModelConfig): RopeTables {
  const half = config.headDim / 2;
  const cos = new Float32Array(config.maxPositions * half);
  const sin = new Float32Array(config.maxPositions * half);
  for (let p = 0; p < config.maxPositions; p++) {
    for (let i = 0; i < half; i++) {
      const invFreq = 1 / config.ropeTheta ** ((2 * i) / config.headDim);
      const angle = p * invFreq;
      cos[p * half + i] = Math.cos(angle);
      sin[p * half + i] = Math.sin(angle);
    }
  }
  return { cos, sin, half };
}

/** Loads a Hugging Face–layout folder: config.json, tokenizer.json, model.safetensors. */
export async function loadModel(dir: string): Promise<Model> {
  const config = parseConfig(JSON.parse(await readFile(join(dir, "config.json"), "utf8")));
  const tokenizer = Tokenizer.fromJson(
    JSON.parse(await readFile(join(dir, "tokenizer.json"), "utf8")),
  );
  const tensors = await readWeights(dir);
  return createModel(config, weightsFromTensors(config, tensors), tokenizer);
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
    for (const [name, tensor] of readSafetensors(await readFile(join(dir, file))).tensors)
      tensors.set(name, tensor);
  }
  return tensors;
}

export async function saveModel(model: Model, dir: string): Promise<void> {
  await mkdir(dir, { recursive: true });
  await writeFile(
    join(dir, "config.json"),
    `${JSON.stringify(configToJson(model.config), null, 2)}\n`,
  );
  await writeFile(join(dir, "tokenizer.json"), JSON.stringify(model.tokenizer.toJson()));
  await writeFile(
    join(dir, "tokenizer_config.json"),
    `${JSON.stringify(tokenizerConfig(model), null, 2)}\n`,
  );
  await writeFile(
    join(dir, "model.safetensors"),
    saveSafetensors(weightsToTensors(model.config, model.weights), { format: "pt" }),
  );
}

/** HF tokenizer_config.json: special tokens and the ChatML chat template. */
export function tokenizerConfig(model: Model): Record<string, unknown> {
  const t = model.tokenizer;
  const name = (id: number | null | undefined) => (id == null ? null : (t.idToToken[id] ?? null));
  return {
    tokenizer_class: "PreTrainedTokenizerFast",
    add_bos_token: false,
    add_eos_token: false,
    bos_token: name(model.config.bosTokenId),
    eos_token: name(model.config.eosTokenId[0]),
    pad_token: t.tokenId(END_OF_TEXT) === undefined ? null : END_OF_TEXT,
    model_max_length: model.config.maxPositions,
    clean_up_tokenization_spaces: false,
    chat_template: CHATML_TEMPLATE,
    added_tokens_decoder: Object.fromEntries(
      t.addedTokens.map((a) => [
        String(a.id),
        {
          content: a.content,
          lstrip: false,
          rstrip: false,
          normalized: false,
          single_word: false,
          special: a.special,
        },
      ]),
    ),
  };
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
