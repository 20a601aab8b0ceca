import { open } from "node:fs/promises";
import { type Weight, weightArray } from "../kernels/weight.ts";
import { configToJson, type ModelConfig, type ModelType } from "./config.ts";
import type { LinearKey, LoraAdapter, LoraModule } from "./lora.ts";
import type { Model } from "./model.ts";
import { type LayerKey, layerKeysOf, layerShape } from "./weights.ts";

/** GGUF v3 (llama.cpp): header, typed key/values, tensor infos, aligned tensor data. */

const GGUF_MAGIC = 0x46554747; // "GGUF" little-endian
const ALIGNMENT = 32;

export const GgufType = {
  UINT8: 0,
  INT8: 1,
  UINT16: 2,
  INT16: 3,
  UINT32: 4,
  INT32: 5,
  FLOAT32: 6,
  BOOL: 7,
  STRING: 8,
  ARRAY: 9,
  UINT64: 10,
  INT64: 11,
  FLOAT64: 12,
} as const;

export type GgufValue =
  | { type: "u32"; value: number }
  | { type: "i32"; value: number }
  | { type: "f32"; value: number }
  | { type: "bool"; value: boolean }
  | { type: "string"; value: string }
  | { type: "string[]"; value: string[] }
  | { type: "i32[]"; value: number[] };

export interface GgufTensorInfo {
  name: string;
  /** ggml order: dims[0] is the fastest-varying (the `in` size of a Linear). */
  dims: number[];
  /** ggml type (`GgmlType`): 0 = F32, 1 = F16, 8 = Q8_0. */
  ggmlType: number;
  offset: number;
}

/** The ggml tensor types the export writes. */
export const GgmlType = { F32: 0, F16: 1, Q8_0: 8 } as const;
type GgmlTypeId = (typeof GgmlType)[keyof typeof GgmlType];

/**
 * What a model GGUF's weight matrices are written as, named as `convert_hf_to_gguf.py
 * --outtype` names them: `f32`, or `q8_0` (ggml's Q8_0: blocks of 32 weights, one F16 scale
 * each; 1-D tensors and norms stay F32, as llama.cpp keeps them).
 */
export type GgufOuttype = "f32" | "q8_0";
export const GGUF_OUTTYPES: readonly GgufOuttype[] = ["f32", "q8_0"];

/** `general.file_type` (llama.cpp's `LlamaFileType`): ALL_F32 0, MOSTLY_Q8_0 7. */
const FILE_TYPE: Record<GgufOuttype, number> = { f32: 0, q8_0: 7 };

/** Weights per Q8_0 block, and the block's bytes: an F16 scale and 32 int8. */
export const Q8_0_BLOCK = 32;
const Q8_0_BLOCK_BYTES = 2 + Q8_0_BLOCK;

export interface GgufFile {
  version: number;
  metadata: Map<string, unknown>;
  tensors: GgufTensorInfo[];
  dataOffset: number;
  tensorData(name: string): Float32Array;
}

class Writer {
  private chunks: Uint8Array[] = [];
  length = 0;
  private push(bytes: Uint8Array): void {
    this.chunks.push(bytes);
    this.length += bytes.length;
  }
  u32(v: number): void {
    const b = new Uint8Array(4);
    new DataView(b.buffer).setUint32(0, v, true);
    this.push(b);
  }
  i32(v: number): void {
    const b = new Uint8Array(4);
    new DataView(b.buffer).setInt32(0, v, true);
    this.push(b);
  }
  u64(v: number): void {
    const b = new Uint8Array(8);
    new DataView(b.buffer).setBigUint64(0, BigInt(v), true);
    this.push(b);
  }
  f32(v: number): void {
    const b = new Uint8Array(4);
    new DataView(b.buffer).setFloat32(0, v, true);
    this.push(b);
  }
  string(s: string): void {
    const bytes = new TextEncoder().encode(s);
    this.u64(bytes.length);
    this.push(bytes);
  }
  bytes(b: Uint8Array): void {
    this.push(b);
  }
  pad(alignment: number): void {
    const rest = this.length % alignment;
    if (rest) this.push(new Uint8Array(alignment - rest));
  }
  value(v: GgufValue): void {
    switch (v.type) {
      case "u32":
        this.u32(GgufType.UINT32);
        this.u32(v.value);
        return;
      case "i32":
        this.u32(GgufType.INT32);
        this.i32(v.value);
        return;
      case "f32":
        this.u32(GgufType.FLOAT32);
        this.f32(v.value);
        return;
      case "bool":
        this.u32(GgufType.BOOL);
        this.push(Uint8Array.of(v.value ? 1 : 0));
        return;
      case "string":
        this.u32(GgufType.STRING);
        this.string(v.value);
        return;
      case "string[]":
        this.u32(GgufType.ARRAY);
        this.u32(GgufType.STRING);
        this.u64(v.value.length);
        for (const s of v.value) this.string(s);
        return;
      case "i32[]":
        this.u32(GgufType.ARRAY);
        this.u32(GgufType.INT32);
        this.u64(v.value.length);
        for (const n of v.value) this.i32(n);
        return;
    }
  }
  concat(): Uint8Array {
    const out = new Uint8Array(this.length);
    let o = 0;
    for (const c of this.chunks) {
      out.set(c, o);
      o += c.length;
    }
    return out;
  }
}

/**
 * llama.cpp's rope works on interleaved pairs, HF's on halves: convert_hf_to_gguf.py's
 * LlamaModel.permute reshapes each head's rows (2, hd/2) → (hd/2, 2). Row j·hd/2+i → i·2+j.
 */
export function permuteForGguf(weight: Float32Array, heads: number, inDim: number): Float32Array {
  const rows = weight.length / inDim;
  const headDim = rows / heads;
  const half = headDim / 2;
  const out = new Float32Array(weight.length);
  for (let h = 0; h < heads; h++) {
    for (let j = 0; j < 2; j++) {
      for (let i = 0; i < half; i++) {
        const from = h * headDim + j * half + i;
        const to = h * headDim + i * 2 + j;
        out.set(weight.subarray(from * inDim, (from + 1) * inDim), to * inDim);
      }
    }
  }
  return out;
}

/** llama.cpp's tensor names for a layer's weights (`blk.N.<name>`). */
const layerNames: Record<LayerKey, string> = {
  inputNorm: "attn_norm.weight",
  q: "attn_q.weight",
  k: "attn_k.weight",
  v: "attn_v.weight",
  o: "attn_output.weight",
  postNorm: "ffn_norm.weight",
  gate: "ffn_gate.weight",
  up: "ffn_up.weight",
  down: "ffn_down.weight",
  qBias: "attn_q.bias",
  kBias: "attn_k.bias",
  vBias: "attn_v.bias",
  oBias: "attn_output.bias",
  qNorm: "attn_q_norm.weight",
  kNorm: "attn_k_norm.weight",
};

/** llama.cpp's architecture for each family. Llama's rope rotates interleaved pairs, so its q/k
 * rows are permuted; Qwen's (NEOX) rotates halves as Hugging Face does. */
const ARCH: Record<ModelType, { name: string; permute: boolean }> = {
  llama: { name: "llama", permute: true },
  smollm3: { name: "smollm3", permute: true },
  qwen2: { name: "qwen2", permute: false },
  qwen3: { name: "qwen3", permute: false },
};

interface GgufTensor {
  name: string;
  dims: number[];
  /** The ggml type it is written as (F32 when absent). */
  type?: GgmlTypeId;
  /** Read when the tensor is written (a packed weight is unpacked then, one at a time). */
  data: Weight;
  /** Q/K rows permuted as `convert_hf_to_gguf.py` does, when written. */
  permute?: { heads: number; inDim: number };
}

/** A model whose tokenizer llama.cpp cannot reproduce: no GGUF is written for it. */
export class GgufTokenizerError extends Error {}

/** An adapter of the output head on a base that ties the head to its embedding: llama.cpp's
 * LoRA GGUF has no tensor of the base to put it on (the base GGUF has no `output.weight`). */
export class GgufHeadError extends Error {
  override name = "GgufHeadError";
  constructor() {
    super(
      "the adapter trains the output head, which this base ties to its embedding: a llama.cpp LoRA GGUF cannot carry it (the base's GGUF has no output tensor to adapt); download format=gguf (the merged model) or peft instead",
    );
  }
}

/**
 * The ggml type llama.cpp's converter gives a model tensor for an outtype (`convert_hf_to_gguf.py`,
 * which `llama-quantize` matches): 1-D tensors and norms stay F32; a 2-D weight is Q8_0 when its
 * rows split into whole blocks of 32, else F16 (the converter's fallback).
 */
export function ggufTensorType(name: string, dims: number[], outtype: GgufOuttype): GgmlTypeId {
  if (outtype === "f32" || dims.length < 2 || name.endsWith("_norm.weight")) return GgmlType.F32;
  if (!name.endsWith(".weight")) return GgmlType.F32;
  return dims[0]! % Q8_0_BLOCK === 0 ? GgmlType.Q8_0 : GgmlType.F16;
}

/** A model as a GGUF of its llama.cpp architecture with a gpt2-style BPE tokenizer, its weight
 * matrices as `outtype`: the header (metadata and tensor infos, padded) and the tensors, in file
 * order. */
function ggufLayout(
  model: Model,
  name: string,
  outtype: GgufOuttype,
): { header: Uint8Array; tensors: GgufTensor[] } {
  const { config, weights, tokenizer } = model;
  const arch = ARCH[config.modelType];
  const D = config.hiddenSize;
  const tensors: GgufTensor[] = [
    { name: "token_embd.weight", dims: [D, config.vocabSize], data: weights.embed },
  ];
  weights.layers.forEach((layer, l) => {
    for (const key of layerKeysOf(config)) {
      const data = layer[key]!;
      const [rows, inDim] = (() => {
        const shape = layerShape(config, key);
        return shape.length === 1 ? [1, shape[0]!] : [shape[0]!, shape[1]!];
      })();
      const heads =
        key === "q" || key === "qBias"
          ? config.numHeads
          : key === "k" || key === "kBias"
            ? config.numKvHeads
            : 0;
      tensors.push({
        name: `blk.${l}.${layerNames[key]}`,
        dims: rows === 1 ? [inDim] : [inDim, rows],
        data,
        ...(arch.permute && heads > 0 ? { permute: { heads, inDim: rows === 1 ? 1 : inDim } } : {}),
      });
    }
  });
  if (config.ropeScaling) {
    tensors.push({
      name: "rope_freqs.weight",
      dims: [config.headDim / 2],
      data: ropeFactors(config),
    });
  }
  tensors.push({ name: "output_norm.weight", dims: [D], data: weights.norm });
  if (weights.lmHead)
    tensors.push({ name: "output.weight", dims: [D, config.vocabSize], data: weights.lmHead });

  const tokens = Array.from(
    { length: config.vocabSize },
    (_, id) => tokenizer.token(id) ?? `[PAD${id}]`,
  );
  const tokenTypes = tokens.map((_, id) =>
    id >= tokenizer.vocabSize ? 5 : tokenizer.isSpecial(id) ? 3 : 1,
  );
  const hf = configToJson(config);
  const preTokenizer = tokenizer.ggufPreTokenizer();
  if (preTokenizer === undefined)
    throw new GgufTokenizerError(
      "gguf: the tokenizer's pre-tokenizer (tokenizer.json) is none that llama.cpp has, so a GGUF would split text differently; it is not written",
    );
  const metadata: [string, GgufValue][] = [
    ["general.architecture", { type: "string", value: arch.name }],
    ["general.name", { type: "string", value: name }],
    ["general.alignment", { type: "u32", value: ALIGNMENT }],
    ["general.file_type", { type: "u32", value: FILE_TYPE[outtype] }],
    [`${arch.name}.vocab_size`, { type: "u32", value: config.vocabSize }],
    [`${arch.name}.context_length`, { type: "u32", value: config.maxPositions }],
    [`${arch.name}.embedding_length`, { type: "u32", value: D }],
    [`${arch.name}.block_count`, { type: "u32", value: config.numLayers }],
    [`${arch.name}.feed_forward_length`, { type: "u32", value: config.intermediateSize }],
    [`${arch.name}.attention.head_count`, { type: "u32", value: config.numHeads }],
    [`${arch.name}.attention.head_count_kv`, { type: "u32", value: config.numKvHeads }],
    [`${arch.name}.attention.key_length`, { type: "u32", value: config.headDim }],
    [`${arch.name}.attention.value_length`, { type: "u32", value: config.headDim }],
    [`${arch.name}.rope.dimension_count`, { type: "u32", value: config.headDim }],
    [`${arch.name}.rope.freq_base`, { type: "f32", value: config.ropeTheta }],
    [`${arch.name}.attention.layer_norm_rms_epsilon`, { type: "f32", value: config.rmsNormEps }],
    ["tokenizer.ggml.model", { type: "string", value: "gpt2" }],
    ["tokenizer.ggml.pre", { type: "string", value: preTokenizer }],
    ["tokenizer.ggml.tokens", { type: "string[]", value: tokens }],
    ["tokenizer.ggml.token_type", { type: "i32[]", value: tokenTypes }],
    ["tokenizer.ggml.merges", { type: "string[]", value: tokenizer.merges() }],
    ["tokenizer.ggml.add_bos_token", { type: "bool", value: false }],
    ["tokenizer.chat_template", { type: "string", value: model.chat.template.source }],
  ];
  if (config.bosTokenId !== null)
    metadata.push(["tokenizer.ggml.bos_token_id", { type: "u32", value: config.bosTokenId }]);
  const eos = config.eosTokenId[0];
  if (eos !== undefined)
    metadata.push(["tokenizer.ggml.eos_token_id", { type: "u32", value: eos }]);
  if (typeof hf["bos_token_id"] === "number") {
    metadata.push(["tokenizer.ggml.padding_token_id", { type: "u32", value: hf["bos_token_id"] }]);
  }

  for (const t of tensors) t.type = ggufTensorType(t.name, t.dims, outtype);
  return { header: ggufHeader(metadata, tensors), tensors };
}

/** A tensor's data bytes in the file, before padding. */
function dataLength(t: GgufTensor): number {
  switch (t.type ?? GgmlType.F32) {
    case GgmlType.F32:
      return t.data.length * 4;
    case GgmlType.F16:
      return t.data.length * 2;
    case GgmlType.Q8_0:
      return (t.data.length / Q8_0_BLOCK) * Q8_0_BLOCK_BYTES;
  }
}

/** The GGUF header: magic, version 3, metadata, tensor infos (typed, aligned), padded. */
function ggufHeader(metadata: [string, GgufValue][], tensors: GgufTensor[]): Uint8Array {
  const w = new Writer();
  w.u32(GGUF_MAGIC);
  w.u32(3);
  w.u64(tensors.length);
  w.u64(metadata.length);
  for (const [key, value] of metadata) {
    w.string(key);
    w.value(value);
  }
  let offset = 0;
  for (const t of tensors) {
    w.string(t.name);
    w.u32(t.dims.length);
    for (const d of t.dims) w.u64(d);
    w.u32(t.type ?? GgmlType.F32);
    w.u64(offset);
    offset += Math.ceil(dataLength(t) / ALIGNMENT) * ALIGNMENT;
  }
  w.pad(ALIGNMENT);
  return w.concat();
}

/**
 * Values as ggml's Q8_0 blocks (`quantize_row_q8_0_ref`): per 32 values, the scale
 * d = max|x| / 127 as little-endian F16, then 32 int8 round(x / d), half away from zero. The
 * arithmetic is F32's, as ggml's is, so the bytes are llama.cpp's own; `out` is filled at `at`.
 */
export function quantizeQ8_0(
  values: Float32Array,
  out = new Uint8Array((values.length / Q8_0_BLOCK) * Q8_0_BLOCK_BYTES),
  at = 0,
): Uint8Array {
  if (values.length % Q8_0_BLOCK !== 0)
    throw new Error(`Q8_0: ${values.length} values do not split into blocks of ${Q8_0_BLOCK}`);
  const view = new DataView(out.buffer, out.byteOffset, out.byteLength);
  const f = Math.fround;
  for (let b = 0, o = at; b < values.length; b += Q8_0_BLOCK, o += Q8_0_BLOCK_BYTES) {
    let amax = 0;
    for (let j = 0; j < Q8_0_BLOCK; j++) amax = Math.max(amax, Math.abs(values[b + j]!));
    const d = f(amax / 127);
    const id = d === 0 ? 0 : f(1 / d);
    view.setFloat16(o, d, true);
    for (let j = 0; j < Q8_0_BLOCK; j++) {
      const x = f(values[b + j]! * id);
      // roundf: half away from zero (Math.round rounds -2.5 to -2).
      view.setInt8(o + 2 + j, Math.sign(x) * Math.round(Math.abs(x)));
    }
  }
  return out;
}

/** Q8_0 blocks back to F32 (x = d · q). */
export function dequantizeQ8_0(bytes: Uint8Array, count: number): Float32Array {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = new Float32Array(count);
  for (let b = 0; b < count / Q8_0_BLOCK; b++) {
    const o = b * Q8_0_BLOCK_BYTES;
    const d = view.getFloat16(o, true);
    for (let j = 0; j < Q8_0_BLOCK; j++) out[b * Q8_0_BLOCK + j] = d * view.getInt8(o + 2 + j);
  }
  return out;
}

/** A tensor's bytes in its ggml type, little-endian, padded to the alignment. */
function tensorBytes(t: GgufTensor): Uint8Array {
  let data = weightArray(t.data);
  if (t.permute) data = permuteForGguf(data, t.permute.heads, t.permute.inDim);
  const bytes = new Uint8Array(Math.ceil(dataLength(t) / ALIGNMENT) * ALIGNMENT);
  const view = new DataView(bytes.buffer);
  switch (t.type ?? GgmlType.F32) {
    case GgmlType.F32:
      for (let i = 0; i < data.length; i++) view.setFloat32(i * 4, data[i]!, true);
      break;
    case GgmlType.F16:
      for (let i = 0; i < data.length; i++) view.setFloat16(i * 2, data[i]!, true);
      break;
    case GgmlType.Q8_0:
      quantizeQ8_0(data, bytes);
      break;
  }
  return bytes;
}

/** Serialises a model as a GGUF, whole in memory (small models and tests). */
export function ggufBytes(
  model: Model,
  name = "arbor-model",
  outtype: GgufOuttype = "f32",
): Uint8Array {
  const { header, tensors } = ggufLayout(model, name, outtype);
  const parts = [header, ...tensors.map(tensorBytes)];
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

/** Writes a model as a GGUF file (F32, or its weight matrices Q8_0), a tensor at a time (never
 * the whole file in memory). */
export async function exportGguf(
  model: Model,
  path: string,
  name = "arbor-model",
  outtype: GgufOuttype = "f32",
): Promise<void> {
  const { header, tensors } = ggufLayout(model, name, outtype);
  await writeGguf(path, header, tensors);
}

/** Reads a GGUF header, metadata and tensor infos (F32, F16 and Q8_0 tensor data on request, as
 * F32). */
export function readGguf(bytes: Uint8Array): GgufFile {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let p = 0;
  const u32 = () => {
    const v = view.getUint32(p, true);
    p += 4;
    return v;
  };
  const u64 = () => {
    const v = Number(view.getBigUint64(p, true));
    p += 8;
    return v;
  };
  const string = () => {
    const n = u64();
    const s = new TextDecoder().decode(bytes.subarray(p, p + n));
    p += n;
    return s;
  };
  const scalar = (type: number): unknown => {
    switch (type) {
      case GgufType.UINT8:
        return view.getUint8(p++);
      case GgufType.INT8:
        return view.getInt8(p++);
      case GgufType.BOOL:
        return view.getUint8(p++) !== 0;
      case GgufType.UINT16:
        p += 2;
        return view.getUint16(p - 2, true);
      case GgufType.INT16:
        p += 2;
        return view.getInt16(p - 2, true);
      case GgufType.UINT32:
        return u32();
      case GgufType.INT32:
        p += 4;
        return view.getInt32(p - 4, true);
      case GgufType.FLOAT32:
        p += 4;
        return view.getFloat32(p - 4, true);
      case GgufType.UINT64:
        return u64();
      case GgufType.INT64:
        p += 8;
        return Number(view.getBigInt64(p - 8, true));
      case GgufType.FLOAT64:
        p += 8;
        return view.getFloat64(p - 8, true);
      case GgufType.STRING:
        return string();
      case GgufType.ARRAY: {
        const inner = u32();
        const n = u64();
        return Array.from({ length: n }, () => scalar(inner));
      }
      default:
        throw new Error(`gguf: unknown value type ${type}`);
    }
  };
  if (u32() !== GGUF_MAGIC) throw new Error("gguf: bad magic");
  const version = u32();
  const tensorCount = u64();
  const kvCount = u64();
  const metadata = new Map<string, unknown>();
  for (let i = 0; i < kvCount; i++) {
    const key = string();
    metadata.set(key, scalar(u32()));
  }
  const tensors: GgufTensorInfo[] = [];
  for (let i = 0; i < tensorCount; i++) {
    const name = string();
    const nd = u32();
    const dims = Array.from({ length: nd }, () => u64());
    tensors.push({ name, dims, ggmlType: u32(), offset: u64() });
  }
  const alignment = (metadata.get("general.alignment") as number | undefined) ?? ALIGNMENT;
  const dataOffset = Math.ceil(p / alignment) * alignment;
  return {
    version,
    metadata,
    tensors,
    dataOffset,
    tensorData(name: string): Float32Array {
      const info = tensors.find((t) => t.name === name);
      if (!info) throw new Error(`gguf: no tensor ${name}`);
      const n = info.dims.reduce((a, b) => a * b, 1);
      const start = dataOffset + info.offset;
      const out = new Float32Array(n);
      switch (info.ggmlType) {
        case GgmlType.F32:
          for (let i = 0; i < n; i++) out[i] = view.getFloat32(start + i * 4, true);
          return out;
        case GgmlType.F16:
          for (let i = 0; i < n; i++) out[i] = view.getFloat16(start + i * 2, true);
          return out;
        case GgmlType.Q8_0:
          return dequantizeQ8_0(bytes.subarray(start), n);
        default:
          throw new Error(`gguf: tensors of ggml type ${info.ggmlType} cannot be read`);
      }
    },
  };
}

/** llama.cpp's `rope_freqs` for Llama 3.1's scaling: each frequency's divisor. */
function ropeFactors(config: ModelConfig): Float32Array {
  const scaling = config.ropeScaling!;
  const { factor, lowFreqFactor, highFreqFactor, originalMaxPositions } = scaling;
  const half = config.headDim / 2;
  return Float32Array.from({ length: half }, (_, i) => {
    const wavelen = (2 * Math.PI) / (1 / config.ropeTheta ** ((2 * i) / config.headDim));
    if (wavelen < originalMaxPositions / highFreqFactor) return 1;
    if (wavelen > originalMaxPositions / lowFreqFactor) return factor;
    const smooth =
      (originalMaxPositions / wavelen - lowFreqFactor) / (highFreqFactor - lowFreqFactor);
    return 1 / ((1 - smooth) / factor + smooth);
  });
}

/**
 * A LoRA adapter as llama.cpp's LoRA GGUF (what `convert_lora_to_gguf.py` writes from a PEFT
 * folder): `general.type` adapter, `adapter.type` lora, `adapter.lora.alpha`, and per adapted
 * linear `<base tensor>.lora_a` (ne [in, r]) and `.lora_b` (ne [r, out]), B's rows permuted as
 * the base's q/k rows are for llama. Loaded beside the base GGUF (`--lora`).
 */
export async function exportLoraGguf(
  config: ModelConfig,
  adapter: LoraAdapter,
  path: string,
  name = "arbor-adapter",
): Promise<void> {
  const arch = ARCH[config.modelType];
  const tensors: GgufTensor[] = [];
  if (adapter.head && config.tieWordEmbeddings) throw new GgufHeadError();
  adapter.layers.forEach((modules, l) => {
    for (const [key, m] of Object.entries(modules) as [LinearKey, LoraModule][]) {
      const base = `blk.${l}.${layerNames[key]}`;
      let b = m.b;
      if (arch.permute && key === "q") b = permuteForGguf(b, config.numHeads, adapter.rank);
      if (arch.permute && key === "k") b = permuteForGguf(b, config.numKvHeads, adapter.rank);
      tensors.push({ name: `${base}.lora_a`, dims: [m.inFeatures, adapter.rank], data: m.a });
      tensors.push({ name: `${base}.lora_b`, dims: [adapter.rank, m.outFeatures], data: b });
    }
  });
  const head = adapter.head;
  if (head) {
    tensors.push({
      name: "output.weight.lora_a",
      dims: [head.inFeatures, adapter.rank],
      data: head.a,
    });
    tensors.push({
      name: "output.weight.lora_b",
      dims: [adapter.rank, head.outFeatures],
      data: head.b,
    });
  }
  const metadata: [string, GgufValue][] = [
    ["general.architecture", { type: "string", value: arch.name }],
    ["general.type", { type: "string", value: "adapter" }],
    ["general.name", { type: "string", value: name }],
    ["general.alignment", { type: "u32", value: ALIGNMENT }],
    ["adapter.type", { type: "string", value: "lora" }],
    ["adapter.lora.alpha", { type: "f32", value: adapter.alpha }],
  ];
  await writeGguf(path, ggufHeader(metadata, tensors), tensors);
}

async function writeGguf(path: string, header: Uint8Array, tensors: GgufTensor[]): Promise<void> {
  const file = await open(path, "w");
  try {
    await file.write(header);
    for (const t of tensors) await file.write(tensorBytes(t));
  } finally {
    await file.close();
  }
}
