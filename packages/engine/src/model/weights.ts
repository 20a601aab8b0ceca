import type { Weight } from "../kernels/weight.ts";
import type { ModelConfig } from "./config.ts";
import { Rng } from "./rng.ts";

/** Linear weights are stored [out, in], as in PyTorch's nn.Linear; a model's may live packed in
 * the kernels' arena (`W` = `Weight`), gradients are plain arrays (`W` = `Float32Array`). Biases and
 * q/k norms exist only in the families that have them (`layerKeysOf`); norms and biases are
 * always plain arrays (they are small). */
export interface LayerWeights<W extends Weight = Weight> {
  inputNorm: Float32Array;
  q: W;
  k: W;
  v: W;
  o: W;
  postNorm: Float32Array;
  gate: W;
  up: W;
  down: W;
  qBias?: Float32Array;
  kBias?: Float32Array;
  vBias?: Float32Array;
  oBias?: Float32Array;
  /** RMSNorm weights over one head of q and of k (Qwen3). */
  qNorm?: Float32Array;
  kNorm?: Float32Array;
}

export type LayerKey = keyof LayerWeights;

export interface ModelWeights<W extends Weight = Weight> {
  embed: W;
  layers: LayerWeights<W>[];
  norm: Float32Array;
  /** Absent when the embeddings are tied. */
  lmHead: W | null;
}

/** Gradients and optimizer moments: the weights' layout in plain arrays. */
export type ModelGrads = ModelWeights<Float32Array>;
export type LayerGrads = LayerWeights<Float32Array>;

export interface ParameterRef<W extends Weight = Weight> {
  name: string;
  shape: number[];
  data: W;
}

/** The keys whose weights are matrices a kernel may keep packed (Linear weights). */
export const linearKeys = ["q", "k", "v", "o", "gate", "up", "down"] as const;

/** The keys every family's layer has. */
export const layerKeys = [
  "inputNorm",
  "q",
  "k",
  "v",
  "o",
  "postNorm",
  "gate",
  "up",
  "down",
] as const satisfies readonly LayerKey[];

/** The keys a layer of this config has: the common ones, plus biases and q/k norms. */
export function layerKeysOf(config: ModelConfig): LayerKey[] {
  const keys: LayerKey[] = [...layerKeys];
  if (config.qkvBias) keys.push("qBias", "kBias", "vBias");
  if (config.oBias) keys.push("oBias");
  if (config.qkNorm) keys.push("qNorm", "kNorm");
  return keys;
}

/**
 * The names of the matrices a loaded model keeps packed: the embeddings, an untied head and
 * every layer's Linear weights.
 */
export function matrixNames(config: ModelConfig): string[] {
  return [
    "model.embed_tokens.weight",
    ...(config.tieWordEmbeddings ? [] : ["lm_head.weight"]),
    ...Array.from({ length: config.numLayers }, (_, l) =>
      linearKeys.map((key) => hfName(l, key)),
    ).flat(),
  ];
}

export function hfName(layer: number, key: LayerKey): string {
  const prefix = `model.layers.${layer}`;
  switch (key) {
    case "inputNorm":
      return `${prefix}.input_layernorm.weight`;
    case "postNorm":
      return `${prefix}.post_attention_layernorm.weight`;
    case "q":
    case "k":
    case "v":
    case "o":
      return `${prefix}.self_attn.${key}_proj.weight`;
    case "qBias":
    case "kBias":
    case "vBias":
    case "oBias":
      return `${prefix}.self_attn.${key[0]}_proj.bias`;
    case "qNorm":
    case "kNorm":
      return `${prefix}.self_attn.${key[0]}_norm.weight`;
    default:
      return `${prefix}.mlp.${key}_proj.weight`;
  }
}

export function layerShape(config: ModelConfig, key: LayerKey): number[] {
  const d = config.hiddenSize;
  const qDim = config.numHeads * config.headDim;
  const kvDim = config.numKvHeads * config.headDim;
  switch (key) {
    case "inputNorm":
    case "postNorm":
    case "oBias":
      return [d];
    case "q":
      return [qDim, d];
    case "k":
    case "v":
      return [kvDim, d];
    case "o":
      return [d, qDim];
    case "gate":
    case "up":
      return [config.intermediateSize, d];
    case "down":
      return [d, config.intermediateSize];
    case "qBias":
      return [qDim];
    case "kBias":
    case "vBias":
      return [kvDim];
    case "qNorm":
    case "kNorm":
      return [config.headDim];
  }
}

/** Norm weights start at 1, biases at 0. */
function isNorm(key: LayerKey): boolean {
  return key === "inputNorm" || key === "postNorm" || key === "qNorm" || key === "kNorm";
}

/** Every parameter with its Hugging Face name, in a fixed order (used by optimizers and I/O). */
export function parameters<W extends Weight>(
  config: ModelConfig,
  weights: ModelWeights<W>,
): ParameterRef<W | Float32Array>[] {
  const out: ParameterRef<W | Float32Array>[] = [
    {
      name: "model.embed_tokens.weight",
      shape: [config.vocabSize, config.hiddenSize],
      data: weights.embed,
    },
  ];
  weights.layers.forEach((layer, i) => {
    for (const key of layerKeysOf(config)) {
      const data = layer[key];
      if (data) out.push({ name: hfName(i, key), shape: layerShape(config, key), data });
    }
  });
  out.push({ name: "model.norm.weight", shape: [config.hiddenSize], data: weights.norm });
  if (weights.lmHead) {
    out.push({
      name: "lm_head.weight",
      shape: [config.vocabSize, config.hiddenSize],
      data: weights.lmHead,
    });
  }
  return out;
}

export function countParameters(config: ModelConfig, weights: ModelWeights): number {
  return parameters(config, weights).reduce((sum, p) => sum + p.data.length, 0);
}

/** Zero-filled weights with the same layout (gradients, optimizer moments). */
export function zerosLike(weights: ModelWeights): ModelGrads {
  return {
    embed: new Float32Array(weights.embed.length),
    layers: weights.layers.map((layer) => {
      const copy = {} as LayerGrads;
      for (const [key, data] of Object.entries(layer) as [LayerKey, Weight][])
        copy[key] = new Float32Array(data.length);
      return copy;
    }),
    norm: new Float32Array(weights.norm.length),
    lmHead: weights.lmHead ? new Float32Array(weights.lmHead.length) : null,
  };
}

/** GPT-2 style init: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers), norms at 1. */
export function initWeights(config: ModelConfig, seed: number): ModelGrads {
  const rng = new Rng(seed);
  const normal = (n: number, std: number) => {
    const a = new Float32Array(n);
    for (let i = 0; i < n; i++) a[i] = rng.normal() * std;
    return a;
  };
  const size = (shape: number[]) => shape.reduce((a, b) => a * b, 1);
  const std = 0.02;
  const residualStd = std / Math.sqrt(2 * config.numLayers);
  const layers: LayerGrads[] = [];
  for (let i = 0; i < config.numLayers; i++) {
    const layer = {} as LayerGrads;
    for (const key of layerKeysOf(config)) {
      const n = size(layerShape(config, key));
      layer[key] = isNorm(key)
        ? new Float32Array(n).fill(1)
        : normal(n, key === "o" || key === "down" ? residualStd : std);
    }
    layers.push(layer);
  }
  return {
    embed: normal(config.vocabSize * config.hiddenSize, std),
    layers,
    norm: new Float32Array(config.hiddenSize).fill(1),
    lmHead: config.tieWordEmbeddings ? null : normal(config.vocabSize * config.hiddenSize, std),
  };
}

export function weightsToTensors(
  config: ModelConfig,
  weights: ModelWeights,
): Map<string, { shape: number[]; data: Weight }> {
  const map = new Map<string, { shape: number[]; data: Weight }>();
  for (const p of parameters(config, weights)) map.set(p.name, { shape: p.shape, data: p.data });
  return map;
}
