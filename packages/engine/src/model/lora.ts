import { mkdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { jsKernels } from "../kernels/js.ts";
import type { Kernels } from "../kernels/types.ts";
import { isWeightSource, type Weight, type WeightSource } from "../kernels/weight.ts";
import type { Model } from "./model.ts";
import { Rng } from "./rng.ts";
import {
  decodeTensor,
  type RawTensor,
  SafetensorsError,
  safetensorsEntries,
  saveSafetensors,
  type TensorMap,
} from "./safetensors.ts";
import { hfName, layerShape } from "./weights.ts";

/** The linear layers an adapter can target, by their Hugging Face / PEFT module names. */
export type LoraTarget =
  | "q_proj"
  | "k_proj"
  | "v_proj"
  | "o_proj"
  | "gate_proj"
  | "up_proj"
  | "down_proj";

export const LORA_TARGETS: readonly LoraTarget[] = [
  "q_proj",
  "k_proj",
  "v_proj",
  "o_proj",
  "gate_proj",
  "up_proj",
  "down_proj",
];

export type LinearKey = "q" | "k" | "v" | "o" | "gate" | "up" | "down";

/** What a hook adapts: a layer's linear, or the output head (`lm_head`, layer -1). */
export type HookKey = LinearKey | "head";

/** PEFT's name of the output head as a target module. */
export const HEAD_TARGET = "lm_head";

const targetKey: Record<LoraTarget, LinearKey> = {
  q_proj: "q",
  k_proj: "k",
  v_proj: "v",
  o_proj: "o",
  gate_proj: "gate",
  up_proj: "up",
  down_proj: "down",
};

export interface LoraConfig {
  /** Rank r of the update B·A. Default 8. */
  rank?: number;
  /** The update is scaled by alpha / r. Default 16. */
  alpha?: number;
  /** Default: all seven linears of every layer. */
  targetModules?: readonly LoraTarget[];
  /** Also adapt the output head (`lm_head`: the tied embedding, on bases that tie it). Default
   * false. */
  head?: boolean;
  /** Written as `base_model_name_or_path`. */
  baseModel?: string;
}

/** One adapted linear: W·x + scale·B·(A·x), with A [r, in] and B [out, r] (PyTorch layout). */
export interface LoraModule {
  a: Float32Array;
  b: Float32Array;
  inFeatures: number;
  outFeatures: number;
}

/** The largest LoRA rank accepted from a file: a job's largest `lora_rank`. */
export const MAX_RANK = 256;

/** The largest `lora_alpha` accepted from a file: a job's largest. */
export const MAX_ALPHA = 10_000;

/**
 * The largest weight magnitude an adapter may hold: the largest finite F16, the narrowest type
 * adapters are saved in. A trained LoRA's weights are far smaller; past it (NaN, ±Infinity,
 * 1e30) an adapter is corrupt or training diverged, and its outputs would be NaN.
 */
export const MAX_ADAPTER_WEIGHT = 65504;

export interface LoraAdapter {
  rank: number;
  alpha: number;
  /** alpha / rank. */
  scale: number;
  targetModules: LoraTarget[];
  baseModel: string;
  /** Per base layer, the adapted linears. */
  layers: Partial<Record<LinearKey, LoraModule>>[];
  /** The output head's update, [vocab, hidden] as B [vocab, r]·A [r, hidden], when adapted. */
  head?: LoraModule;
}

/** The module a hook's (layer, key) names: a layer's linear, or the head. */
function moduleOf(adapter: LoraAdapter, layer: number, key: HookKey): LoraModule | undefined {
  return key === "head" ? adapter.head : adapter.layers[layer]?.[key];
}

export interface LoraParameter {
  /** PEFT tensor name, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. */
  name: string;
  shape: number[];
  data: Float32Array;
}

/**
 * A fresh adapter for a model: A drawn like PEFT's default (Kaiming-uniform, bound 1/√in) under
 * the seed, B = 0, so step 0 is exactly the base model.
 */
export function createLoraAdapter(
  model: Pick<Model, "config">,
  config: LoraConfig = {},
  seed = 0,
): LoraAdapter {
  const adapter = zeroAdapter(model, config);
  const rng = new Rng(seed);
  const init = (m: LoraModule) => {
    const bound = 1 / Math.sqrt(m.inFeatures);
    for (let i = 0; i < m.a.length; i++) m.a[i] = (2 * rng.next() - 1) * bound;
  };
  for (const modules of adapter.layers) {
    for (const target of LORA_TARGETS) {
      const m = modules[targetKey[target]];
      if (m) init(m);
    }
  }
  if (adapter.head) init(adapter.head);
  return adapter;
}

/** An adapter whose A and B are all zero (to be filled from a file). */
function zeroAdapter(model: Pick<Model, "config">, config: LoraConfig): LoraAdapter {
  const rank = config.rank ?? 8;
  const alpha = config.alpha ?? 16;
  if (!Number.isInteger(rank) || rank < 1) throw new Error("lora: rank must be a positive integer");
  const targetModules = [...(config.targetModules ?? LORA_TARGETS)];
  for (const t of targetModules) {
    if (!(t in targetKey)) throw new Error(`lora: unknown target module ${t}`);
  }
  const layers = Array.from({ length: model.config.numLayers }, () => {
    const modules: Partial<Record<LinearKey, LoraModule>> = {};
    for (const target of LORA_TARGETS) {
      if (!targetModules.includes(target)) continue;
      const [outFeatures, inFeatures] = layerShape(model.config, targetKey[target]) as [
        number,
        number,
      ];
      modules[targetKey[target]] = {
        a: new Float32Array(rank * inFeatures),
        b: new Float32Array(outFeatures * rank),
        inFeatures,
        outFeatures,
      };
    }
    return modules;
  });
  const { hiddenSize, vocabSize } = model.config;
  return {
    rank,
    alpha,
    scale: alpha / rank,
    targetModules: LORA_TARGETS.filter((t) => targetModules.includes(t)),
    baseModel: config.baseModel ?? "",
    layers,
    ...(config.head
      ? {
          head: {
            a: new Float32Array(rank * hiddenSize),
            b: new Float32Array(vocabSize * rank),
            inFeatures: hiddenSize,
            outFeatures: vocabSize,
          },
        }
      : {}),
  };
}

/** Throws unless the adapter's layers and module shapes fit the model. */
export function checkAdapter(model: Model, adapter: LoraAdapter): void {
  if (adapter.layers.length !== model.config.numLayers) {
    throw new Error(
      `lora: adapter has ${adapter.layers.length} layers, the model ${model.config.numLayers}`,
    );
  }
  adapter.layers.forEach((modules, l) => {
    for (const [key, m] of Object.entries(modules) as [LinearKey, LoraModule][]) {
      const [out, inF] = layerShape(model.config, key) as [number, number];
      if (
        m.inFeatures !== inF ||
        m.outFeatures !== out ||
        m.a.length !== adapter.rank * inF ||
        m.b.length !== out * adapter.rank
      ) {
        throw new Error(`lora: layer ${l} ${key}_proj does not fit the model's [${out}, ${inF}]`);
      }
    }
  });
  const head = adapter.head;
  const { hiddenSize, vocabSize } = model.config;
  if (
    head &&
    (head.inFeatures !== hiddenSize ||
      head.outFeatures !== vocabSize ||
      head.a.length !== adapter.rank * hiddenSize ||
      head.b.length !== vocabSize * adapter.rank)
  ) {
    throw new Error(`lora: lm_head does not fit the model's [${vocabSize}, ${hiddenSize}]`);
  }
}

/** PEFT's module path: the base weight's name (`hfName`) under `base_model.model.`, minus `.weight`. */
function peftPrefix(layer: number, key: LinearKey): string {
  return `base_model.model.${hfName(layer, key).replace(/\.weight$/, "")}`;
}

/** The trainable tensors, A then B per module, in a fixed order (optimizer and file order). */
export function loraParameters(adapter: LoraAdapter): LoraParameter[] {
  const out: LoraParameter[] = [];
  adapter.layers.forEach((modules, l) => {
    for (const target of LORA_TARGETS) {
      const key = targetKey[target];
      const m = modules[key];
      if (!m) continue;
      const prefix = peftPrefix(l, key);
      out.push({ name: `${prefix}.lora_A.weight`, shape: [adapter.rank, m.inFeatures], data: m.a });
      out.push({
        name: `${prefix}.lora_B.weight`,
        shape: [m.outFeatures, adapter.rank],
        data: m.b,
      });
    }
  });
  const head = adapter.head;
  if (head) {
    const prefix = `base_model.model.${HEAD_TARGET}`;
    out.push({
      name: `${prefix}.lora_A.weight`,
      shape: [adapter.rank, head.inFeatures],
      data: head.a,
    });
    out.push({
      name: `${prefix}.lora_B.weight`,
      shape: [head.outFeatures, adapter.rank],
      data: head.b,
    });
  }
  return out;
}

export function loraParameterCount(adapter: LoraAdapter): number {
  return loraParameters(adapter).reduce((n, p) => n + p.data.length, 0);
}

/** A deep copy (e.g. to keep a snapshot while training goes on). */
export function cloneAdapter(adapter: LoraAdapter): LoraAdapter {
  return {
    ...adapter,
    targetModules: [...adapter.targetModules],
    layers: adapter.layers.map((modules) => {
      const copy: Partial<Record<LinearKey, LoraModule>> = {};
      for (const [key, m] of Object.entries(modules) as [LinearKey, LoraModule][]) {
        copy[key] = { ...m, a: Float32Array.from(m.a), b: Float32Array.from(m.b) };
      }
      return copy;
    }),
    ...(adapter.head
      ? {
          head: {
            ...adapter.head,
            a: Float32Array.from(adapter.head.a),
            b: Float32Array.from(adapter.head.b),
          },
        }
      : {}),
  };
}

/** Zero-filled tensors with the adapter's layout (gradients). */
export function zerosLikeAdapter(adapter: LoraAdapter): LoraAdapter {
  const copy = cloneAdapter(adapter);
  for (const p of loraParameters(copy)) p.data.fill(0);
  return copy;
}

/** `adapter_config.json` in PEFT's LoraConfig layout. */
export function adapterConfigJson(adapter: LoraAdapter): Record<string, unknown> {
  return {
    peft_type: "LORA",
    task_type: "CAUSAL_LM",
    base_model_name_or_path: adapter.baseModel,
    r: adapter.rank,
    lora_alpha: adapter.alpha,
    lora_dropout: 0,
    target_modules: adapter.head ? [...adapter.targetModules, HEAD_TARGET] : adapter.targetModules,
    bias: "none",
    fan_in_fan_out: false,
    inference_mode: true,
    init_lora_weights: true,
    modules_to_save: null,
    use_rslora: false,
    use_dora: false,
    revision: null,
  };
}

/** The two files of a PEFT adapter folder, as bytes (for blob stores). */
export function adapterToFiles(adapter: LoraAdapter): Record<string, Uint8Array> {
  const tensors: TensorMap = new Map();
  for (const p of loraParameters(adapter)) tensors.set(p.name, { shape: p.shape, data: p.data });
  return {
    "adapter_config.json": new TextEncoder().encode(
      `${JSON.stringify(adapterConfigJson(adapter), null, 2)}\n`,
    ),
    "adapter_model.safetensors": saveSafetensors(tensors, { format: "pt" }),
  };
}

/** A PEFT adapter that does not fit its base; `param` names the file, field or tensor at fault. */
export class AdapterError extends Error {
  override name = "AdapterError";
  readonly param: string;
  constructor(param: string, message: string) {
    super(message);
    this.param = param;
  }
}

/**
 * Reads a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) for a base model,
 * checking its config (`r` up to MAX_RANK, `lora_alpha` above 0 up to MAX_ALPHA) and every
 * tensor's name and shape against the base (F32, F16 or BF16; no other tensor, none twice), then
 * every weight (finite, of magnitude at most MAX_ADAPTER_WEIGHT). The header's size and tensor
 * count are bounded by what the base can need before it is parsed. Tensor names may carry PEFT's
 * adapter-name infix (`lora_A.default.weight`). Throws an `AdapterError` naming the field or
 * tensor.
 */
export function adapterFromFiles(
  files: Record<string, Uint8Array | undefined>,
  baseModel: Pick<Model, "config">,
): LoraAdapter {
  const CONFIG = "adapter_config.json";
  const WEIGHTS = "adapter_model.safetensors";
  const configBytes = files[CONFIG];
  const weightBytes = files[WEIGHTS];
  if (!configBytes) throw new AdapterError(CONFIG, `${CONFIG} is missing.`);
  if (!weightBytes) throw new AdapterError(WEIGHTS, `${WEIGHTS} is missing.`);
  let json: Record<string, unknown>;
  try {
    json = JSON.parse(new TextDecoder().decode(configBytes)) as Record<string, unknown>;
  } catch (err) {
    throw new AdapterError(CONFIG, `${CONFIG} is not JSON: ${(err as Error).message}`);
  }
  if (typeof json !== "object" || json === null || Array.isArray(json)) {
    throw new AdapterError(CONFIG, `${CONFIG} is not a JSON object.`);
  }
  const field = (key: string, why: string): never => {
    throw new AdapterError(key, `${CONFIG}: ${key} ${why}`);
  };
  if (json.peft_type !== undefined && json.peft_type !== "LORA") {
    field("peft_type", `is ${JSON.stringify(json.peft_type)}; only LORA adapters are supported.`);
  }
  const rank = json.r;
  if (typeof rank !== "number" || !Number.isInteger(rank) || rank < 1 || rank > MAX_RANK) {
    field("r", `must be an integer from 1 to ${MAX_RANK}, not ${JSON.stringify(rank)}.`);
  }
  const alpha = json.lora_alpha ?? rank;
  if (typeof alpha !== "number" || !(alpha > 0 && alpha <= MAX_ALPHA)) {
    field(
      "lora_alpha",
      `must be a number above 0 and at most ${MAX_ALPHA}, not ${JSON.stringify(alpha)}.`,
    );
  }
  if (json.use_rslora === true) field("use_rslora", "is true; rsLoRA is not supported.");
  if (json.use_dora === true) field("use_dora", "is true; DoRA is not supported.");
  for (const key of ["rank_pattern", "alpha_pattern"]) {
    const value = json[key];
    if (value && typeof value === "object" && Object.keys(value).length > 0) {
      field(key, "is set; per-module ranks are not supported.");
    }
  }
  for (const key of ["layers_to_transform", "modules_to_save"]) {
    if (json[key] !== undefined && json[key] !== null) field(key, "is set; it is not supported.");
  }
  if (json.bias !== undefined && json.bias !== "none") {
    field("bias", `is ${JSON.stringify(json.bias)}; only "none" is supported.`);
  }
  let targets = json.target_modules;
  if (typeof targets === "string") targets = [targets];
  if (!Array.isArray(targets) || targets.length === 0) {
    field("target_modules", "must be a non-empty list of module names.");
  }
  const listed = targets as unknown[];
  const unknown = listed.filter(
    (t) =>
      t !== "all-linear" && t !== HEAD_TARGET && !(LORA_TARGETS as readonly unknown[]).includes(t),
  );
  if (unknown.length > 0) {
    field(
      "target_modules",
      `names ${JSON.stringify(unknown[0])}; this base's modules are ${[...LORA_TARGETS, HEAD_TARGET].join(", ")}.`,
    );
  }
  const targetModules = listed.includes("all-linear")
    ? [...LORA_TARGETS]
    : LORA_TARGETS.filter((t) => listed.includes(t));
  const adapter = zeroAdapter(baseModel, {
    rank: rank as number,
    alpha: alpha as number,
    targetModules,
    head: listed.includes(HEAD_TARGET),
    baseModel: typeof json.base_model_name_or_path === "string" ? json.base_model_name_or_path : "",
  });
  const expected = loraParameters(adapter);
  // Bounded before the header is parsed: two tensors per linear of each layer and of the head
  // at most, and a header of about a kilobyte per tensor.
  const maxTensors = 2 * LORA_TARGETS.length * baseModel.config.numLayers + (adapter.head ? 2 : 0);
  let tensors: Map<string, RawTensor>;
  try {
    tensors = safetensorsEntries(weightBytes, {
      maxTensors,
      maxHeaderBytes: 64 * 1024 + 1024 * maxTensors,
    }).tensors;
  } catch (err) {
    throw new AdapterError(
      err instanceof SafetensorsError ? (err.tensor ?? WEIGHTS) : WEIGHTS,
      `${WEIGHTS}: ${(err as Error).message.replace(/^safetensors: /, "")}.`,
    );
  }
  const byName = new Map<string, RawTensor>();
  for (const [name, t] of tensors) {
    const peftName = name.replace(/\.lora_([AB])\.default\./, ".lora_$1.");
    if (byName.has(peftName)) {
      throw new AdapterError(peftName, `${WEIGHTS}: holds ${peftName} twice (as ${name} too).`);
    }
    byName.set(peftName, t);
  }
  for (const p of expected) {
    const t = byName.get(p.name);
    if (!t) throw new AdapterError(p.name, `${WEIGHTS}: missing tensor ${p.name}.`);
    if (t.shape.join(",") !== p.shape.join(",")) {
      throw new AdapterError(
        p.name,
        `${WEIGHTS}: ${p.name} has shape [${t.shape.join(", ")}], the base needs [${p.shape.join(", ")}] (r ${rank}).`,
      );
    }
  }
  const names = new Set(expected.map((p) => p.name));
  const extra = [...byName.keys()].find((name) => !names.has(name));
  if (extra !== undefined) {
    throw new AdapterError(extra, `${WEIGHTS}: unexpected tensor ${extra} for this base model.`);
  }
  for (const p of expected) {
    decodeTensor(byName.get(p.name)!, p.name, p.data);
    const bad = outOfBounds(p.data);
    if (bad >= 0)
      throw new AdapterError(p.name, `${WEIGHTS}: ${weightProblem(p.name, p.data, bad)}`);
  }
  return adapter;
}

/** The index of the first weight that is not finite or is larger than MAX_ADAPTER_WEIGHT, or -1. */
function outOfBounds(data: Float32Array): number {
  for (let i = 0; i < data.length; i++) {
    // NaN fails the comparison too.
    if (!(Math.abs(data[i]!) <= MAX_ADAPTER_WEIGHT)) return i;
  }
  return -1;
}

function weightProblem(name: string, data: Float32Array, index: number): string {
  return `${name} holds ${data[index]} at index ${index}; every weight must be a finite number of magnitude at most ${MAX_ADAPTER_WEIGHT}.`;
}

/**
 * The first weight of the adapter that is not finite or is larger than MAX_ADAPTER_WEIGHT, as a
 * sentence naming its tensor (`name`), or undefined when every weight is sound.
 */
export function adapterWeightProblem(
  adapter: LoraAdapter,
): { name: string; message: string } | undefined {
  for (const p of loraParameters(adapter)) {
    const bad = outOfBounds(p.data);
    if (bad >= 0) return { name: p.name, message: weightProblem(p.name, p.data, bad) };
  }
  return undefined;
}

export async function saveAdapter(adapter: LoraAdapter, dir: string): Promise<void> {
  await mkdir(dir, { recursive: true });
  for (const [name, bytes] of Object.entries(adapterToFiles(adapter))) {
    await writeFile(join(dir, name), bytes);
  }
}

export async function loadAdapter(dir: string, baseModel: Model): Promise<LoraAdapter> {
  return adapterFromFiles(
    {
      "adapter_config.json": await readFile(join(dir, "adapter_config.json")),
      "adapter_model.safetensors": await readFile(join(dir, "adapter_model.safetensors")),
    },
    baseModel,
  );
}

/**
 * The one adapter interface of the decoder block (`block.ts`), for inference and training
 * alike: called after every base linear. `forward` adds the adapter's output; `backward`
 * (present when training) adds its input gradient and accumulates its own A/B gradients.
 */
export interface LinearHooks {
  forward(layer: number, key: HookKey, out: Float32Array, x: Float32Array, rows: number): void;
  backward?(
    layer: number,
    key: HookKey,
    dOut: Float32Array,
    x: Float32Array,
    dX: Float32Array,
    rows: number,
  ): void;
}

/**
 * LoRA hooks for `lossAndGradients`: pass `grads` (e.g. from `zerosLikeAdapter`) to train the
 * adapter; A·x is kept from forward to backward.
 */
export function loraHooks(
  adapter: LoraAdapter,
  kernels: Kernels,
  grads: LoraAdapter | null,
): LinearHooks {
  const r = adapter.rank;
  const s = adapter.scale;
  const saved = new Map<string, Float32Array>();
  const hooks: LinearHooks = {
    forward(layer, key, out, x, rows) {
      const m = moduleOf(adapter, layer, key);
      if (!m) return;
      const xa = new Float32Array(rows * r);
      kernels.matmulNT(xa, x, m.a, rows, r, m.inFeatures);
      for (let i = 0; i < xa.length; i++) xa[i] = xa[i]! * s;
      // out += (s·A·x)·Bᵀ, summed onto out as in inference (`loraRowHooks`).
      kernels.matmulNT(out, xa, m.b, rows, m.outFeatures, r, true);
      if (grads) saved.set(`${layer}.${key}`, xa);
    },
  };
  if (grads) {
    hooks.backward = (layer, key, dOut, x, dX, rows) => {
      const m = moduleOf(adapter, layer, key);
      const g = moduleOf(grads, layer, key);
      const xa = saved.get(`${layer}.${key}`);
      if (!m || !g || !xa) return;
      saved.delete(`${layer}.${key}`);
      // dB = dOutᵀ·(s·A·x); d(s·A·x) = dOut·B; dA = s·(dOut·B)ᵀ·x; dX += s·(dOut·B)·A.
      kernels.matmulTN(g.b, dOut, xa, m.outFeatures, r, rows, true);
      const dxa = new Float32Array(rows * r);
      kernels.matmulNN(dxa, dOut, m.b, rows, r, m.outFeatures);
      for (let i = 0; i < dxa.length; i++) dxa[i] = dxa[i]! * s;
      // dAᵀ = xᵀ·dxa: the wide x is read in place and only the rank-wide dxa is packed.
      const inF = m.inFeatures;
      const dAT = new Float32Array(inF * r);
      kernels.matmulTN(dAT, x, dxa, inF, r, rows);
      for (let j = 0; j < r; j++)
        for (let i = 0; i < inF; i++) g.a[j * inF + i] = g.a[j * inF + i]! + dAT[i * r + j]!;
      kernels.matmulNN(dX, dxa, m.a, rows, m.inFeatures, r, true);
    };
  }
  return hooks;
}

/**
 * LoRA hooks for a batched inference pass (`forwardBatch`): each item's rows get its own
 * adapter (or none). Rows are grouped by adapter (all sequences with the same adapter form one
 * pair of low-rank GEMMs, gathered if not adjacent), and each group's update is added to the
 * base output. A row's result does not depend on the grouping.
 */
export function loraRowHooks(
  kernels: Kernels,
  items: readonly { tokens: readonly number[]; adapter?: LoraAdapter | null }[],
): LinearHooks {
  const groups = new Map<LoraAdapter, [number, number][]>();
  let row = 0;
  for (const item of items) {
    const n = item.tokens.length;
    const adapter = item.adapter;
    if (adapter && n > 0) {
      const segments = groups.get(adapter) ?? [];
      const last = segments.at(-1);
      if (last && last[0] + last[1] === row) last[1] += n;
      else segments.push([row, n]);
      groups.set(adapter, segments);
    }
    row += n;
  }
  return {
    forward(layer, key, out, x) {
      for (const [adapter, segments] of groups)
        addLoraRows(kernels, adapter, segments, layer, key, out, x);
    },
  };
}

/** One adapter's update on its row segments of a linear's output. */
function addLoraRows(
  kernels: Kernels,
  adapter: LoraAdapter,
  segments: readonly [number, number][],
  layer: number,
  key: HookKey,
  out: Float32Array,
  x: Float32Array,
): void {
  const m = moduleOf(adapter, layer, key);
  if (!m) return;
  const { inFeatures: inDim, outFeatures: outDim } = m;
  const r = adapter.rank;
  const rows = segments.reduce((sum, [, n]) => sum + n, 0);
  let xs: Float32Array;
  if (segments.length === 1) {
    const [start] = segments[0]!;
    xs = x.subarray(start * inDim, (start + rows) * inDim);
  } else {
    xs = new Float32Array(rows * inDim);
    let at = 0;
    for (const [start, n] of segments) {
      xs.set(x.subarray(start * inDim, (start + n) * inDim), at * inDim);
      at += n;
    }
  }
  const xa = new Float32Array(rows * r);
  kernels.matmulNT(xa, xs, m.a, rows, r, inDim);
  for (let k = 0; k < xa.length; k++) xa[k] = xa[k]! * adapter.scale;
  // out += xa·Bᵀ, summed onto each row's base output (as in training's `loraHooks`).
  if (segments.length === 1) {
    const [start] = segments[0]!;
    kernels.matmulNT(out.subarray(start * outDim), xa, m.b, rows, outDim, r, true);
    return;
  }
  const ys = new Float32Array(rows * outDim);
  let at = 0;
  for (const [start, n] of segments) {
    ys.set(out.subarray(start * outDim, (start + n) * outDim), at * outDim);
    at += n;
  }
  kernels.matmulNT(ys, xa, m.b, rows, outDim, r, true);
  at = 0;
  for (const [start, n] of segments) {
    out.set(ys.subarray(at * outDim, (at + n) * outDim), start * outDim);
    at += n;
  }
}

/**
 * The base model with the adapter folded in (W + (α/r)·B·A for every adapted linear), as a new
 * model: the base's weights are not changed. An adapted weight is computed when it is read, a
 * block of rows at a time (`MergedWeight`), so exporting the merged model (a GGUF) unpacks one
 * tensor at a time and never holds a second copy of the model.
 */
export function mergeAdapter(model: Model, adapter: LoraAdapter): Model {
  checkAdapter(model, adapter);
  const layers = model.weights.layers.map((layer, l) => {
    const merged = { ...layer };
    for (const [key, m] of Object.entries(adapter.layers[l] ?? {}) as [LinearKey, LoraModule][]) {
      merged[key] = new MergedWeight(layer[key], m, adapter.scale);
    }
    return merged;
  });
  // An adapted head is its own tensor from then on, even where the base ties it to the
  // embedding: the input embedding stays the base's.
  const head = adapter.head;
  if (!head) return { ...model, weights: { ...model.weights, layers }, version: model.version + 1 };
  return {
    ...model,
    config: { ...model.config, tieWordEmbeddings: false },
    weights: {
      ...model.weights,
      layers,
      lmHead: new MergedWeight(model.weights.lmHead ?? model.weights.embed, head, adapter.scale),
    },
    version: model.version + 1,
  };
}

/** A base weight W[out, in] plus scale·B·A, computed per block of rows when read. */
class MergedWeight implements WeightSource {
  readonly rows: number;
  readonly cols: number;
  private readonly base: Weight;
  private readonly module: LoraModule;
  private readonly scaledB: Float32Array;

  constructor(base: Weight, module: LoraModule, scale: number) {
    this.base = base;
    this.module = module;
    this.rows = module.outFeatures;
    this.cols = module.inFeatures;
    this.scaledB = Float32Array.from(module.b, (v) => v * scale);
  }

  get length(): number {
    return this.rows * this.cols;
  }

  readRows(r0: number, r1: number, out?: Float32Array): Float32Array {
    const { cols } = this;
    const rank = this.module.a.length / cols;
    const w = out ?? new Float32Array((r1 - r0) * cols);
    const base = this.base;
    if (isWeightSource(base)) base.readRows(r0, r1, w);
    else w.set(base.subarray(r0 * cols, r1 * cols));
    const b = this.scaledB.subarray(r0 * rank, r1 * rank);
    jsKernels.matmulNN(w, b, this.module.a, r1 - r0, cols, rank, true);
    return w;
  }
}
