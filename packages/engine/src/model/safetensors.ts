/** Minimal safetensors reader/writer: 8-byte LE header length, JSON header, raw little-endian data. */
import { open } from "node:fs/promises";
import { type Weight, weightArray } from "../kernels/weight.ts";

export type Dtype = "F32" | "F16" | "BF16";

export interface NamedTensor {
  shape: number[];
  data: Float32Array;
}

export type TensorMap = Map<string, NamedTensor>;

/** A safetensors file that cannot be read; `tensor` names the entry at fault, when one is. */
export class SafetensorsError extends Error {
  override name = "SafetensorsError";
  readonly tensor: string | undefined;
  constructor(message: string, tensor?: string) {
    super(`safetensors: ${message}`);
    this.tensor = tensor;
  }
}

/** What a file held in memory may ask of its reader before anything of it is parsed. */
export interface SafetensorsLimits {
  /** The largest JSON header, in bytes. Default 100 MiB. */
  maxHeaderBytes?: number;
  /** The most tensors the header may list (`__metadata__` aside). Default: no limit. */
  maxTensors?: number;
}

/** A tensor of a file held in memory: its header entry and its raw little-endian bytes. */
export interface RawTensor {
  dtype: Dtype;
  shape: number[];
  raw: Uint8Array;
}

const MAX_HEADER_BYTES = 100 * 1024 * 1024;

/**
 * The header of a safetensors file held in memory, checked: its size and tensor count within
 * `limits` before it is parsed, no key twice in one object, every entry's dtype, shape and
 * offsets within the file. Nothing is decoded: each tensor is a view of its bytes.
 */
export function safetensorsEntries(
  bytes: Uint8Array,
  limits: SafetensorsLimits = {},
): { tensors: Map<string, RawTensor>; metadata: Record<string, string> } {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  if (bytes.byteLength < 8) throw new SafetensorsError("truncated (no header)");
  const headerLength = Number(view.getBigUint64(0, true));
  const maxHeaderBytes = limits.maxHeaderBytes ?? MAX_HEADER_BYTES;
  if (headerLength > maxHeaderBytes) {
    throw new SafetensorsError(
      `the header is ${headerLength} bytes, more than the ${maxHeaderBytes} allowed`,
    );
  }
  if (8 + headerLength > bytes.byteLength) {
    throw new SafetensorsError("truncated (the header runs past the end)");
  }
  const text = new TextDecoder().decode(bytes.subarray(8, 8 + headerLength));
  scanHeader(text, limits.maxTensors ?? Number.POSITIVE_INFINITY);
  let header: Record<string, unknown>;
  try {
    header = JSON.parse(text);
  } catch {
    throw new SafetensorsError("the header is not JSON");
  }
  if (typeof header !== "object" || header === null || Array.isArray(header)) {
    throw new SafetensorsError("the header is not a JSON object");
  }
  const base = 8 + headerLength;
  const tensors = new Map<string, RawTensor>();
  let metadata: Record<string, string> = {};
  for (const [name, entry] of Object.entries(header)) {
    if (name === "__metadata__") {
      metadata = entry as Record<string, string>;
      continue;
    }
    const { dtype, shape, data_offsets } = (entry ?? {}) as {
      dtype: string;
      shape: number[];
      data_offsets: [number, number];
    };
    const size = DTYPE_BYTES[dtype];
    if (size === undefined)
      throw new SafetensorsError(`unsupported dtype ${dtype} for ${name}`, name);
    const [start, end] = Array.isArray(data_offsets) ? data_offsets : [];
    const count =
      Array.isArray(shape) && shape.every((d) => Number.isSafeInteger(d) && d >= 0)
        ? shape.reduce((a, b) => a * b, 1)
        : Number.NaN;
    if (
      !Number.isSafeInteger(start) ||
      !Number.isSafeInteger(end) ||
      start! < 0 ||
      end! - start! !== count * size
    ) {
      throw new SafetensorsError(`${name}'s data_offsets do not fit its shape and dtype`, name);
    }
    if (base + end! > bytes.byteLength) {
      throw new SafetensorsError(`truncated (${name} ends past the end of the file)`);
    }
    tensors.set(name, {
      dtype: dtype as Dtype,
      shape,
      raw: bytes.subarray(base + start!, base + end!),
    });
  }
  return { tensors, metadata };
}

/** Every tensor of a safetensors file held in memory, widened to F32 (see safetensorsEntries). */
export function readSafetensors(
  bytes: Uint8Array,
  limits: SafetensorsLimits = {},
): {
  tensors: TensorMap;
  metadata: Record<string, string>;
} {
  const { tensors: entries, metadata } = safetensorsEntries(bytes, limits);
  const tensors: TensorMap = new Map();
  for (const [name, entry] of entries) {
    tensors.set(name, { shape: entry.shape, data: decode(entry.raw, entry.dtype, name) });
  }
  return { tensors, metadata };
}

/** A raw tensor widened to F32, into `out` (of its length) when given. */
export function decodeTensor(tensor: RawTensor, name: string, out?: Float32Array): Float32Array {
  return decode(tensor.raw, tensor.dtype, name, out);
}

const isSpace = (c: number) => c === 0x20 || c === 0x0a || c === 0x0d || c === 0x09;

/**
 * Walks a header's JSON text before it is parsed: counts the tensors it lists, refusing as soon
 * as there are more than `maxTensors`, and refuses a key written twice in one object (JSON.parse
 * would keep the last one silently). Malformed JSON is left for JSON.parse to report.
 */
function scanHeader(text: string, maxTensors: number): void {
  // Per open container: the keys seen so far, or null for an array.
  const open: (Set<string> | null)[] = [];
  let tensors = 0;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    if (c === 0x7b) open.push(new Set());
    else if (c === 0x5b) open.push(null);
    else if (c === 0x7d || c === 0x5d) open.pop();
    else if (c === 0x22) {
      let end = i + 1;
      let escaped = false;
      for (; end < text.length; end++) {
        const d = text.charCodeAt(end);
        if (d === 0x22) break;
        if (d === 0x5c) {
          escaped = true;
          end++;
        }
      }
      if (end >= text.length) return;
      const keys = open.at(-1);
      let next = end + 1;
      while (next < text.length && isSpace(text.charCodeAt(next))) next++;
      // In an object, a string followed by a colon is a key.
      if (keys && text.charCodeAt(next) === 0x3a) {
        let key: string;
        try {
          key = escaped ? (JSON.parse(text.slice(i, end + 1)) as string) : text.slice(i + 1, end);
        } catch {
          return;
        }
        if (keys.has(key)) throw new SafetensorsError(`the header names ${key} twice`, key);
        keys.add(key);
        if (open.length === 1 && key !== "__metadata__" && ++tensors > maxTensors) {
          throw new SafetensorsError(`the header lists more than ${maxTensors} tensors`);
        }
      }
      i = end;
    }
  }
}

interface HeaderEntry {
  dtype: string;
  shape: number[];
  data_offsets: [number, number];
}

/** A tensor of an open safetensors file: its header entry, read a block of rows at a time. */
export interface SafetensorsEntry {
  dtype: Dtype;
  shape: number[];
  /** Rows [r0, r1) (for a vector: elements) widened to F32. */
  read(r0: number, r1: number): Promise<Float32Array>;
}

/**
 * Opens a safetensors file and checks its header (dtypes, offsets within the file); tensors are
 * then read with positioned reads, a block of rows at a time, so a file is never held whole.
 * Errors name the file and the tensor. `close()` when done.
 */
export async function openSafetensors(
  path: string,
): Promise<{ tensors: Map<string, SafetensorsEntry>; close(): Promise<void> }> {
  const file = await open(path, "r");
  try {
    const { size } = await file.stat();
    const fail = (why: string): never => {
      throw new Error(`${path}: ${why}`);
    };
    if (size < 8) fail("truncated (no header)");
    const head = Buffer.alloc(8);
    await file.read(head, 0, 8, 0);
    const headerLength = Number(head.readBigUInt64LE(0));
    if (headerLength > size - 8 || headerLength > 100 * 1024 * 1024)
      fail("truncated or not safetensors");
    const headerBytes = Buffer.alloc(headerLength);
    await file.read(headerBytes, 0, headerLength, 8);
    let header: Record<string, unknown>;
    try {
      header = JSON.parse(headerBytes.toString("utf8")) as Record<string, unknown>;
    } catch {
      return fail("the header is not valid JSON");
    }
    const base = 8 + headerLength;
    const tensors = new Map<string, SafetensorsEntry>();
    for (const [name, value] of Object.entries(header)) {
      if (name === "__metadata__") continue;
      const { dtype, shape, data_offsets } = value as HeaderEntry;
      const width = DTYPE_BYTES[dtype];
      if (width === undefined) fail(`safetensors: unsupported dtype ${dtype} for ${name}`);
      const [start, end] = data_offsets;
      if (base + end > size) fail(`truncated: ${name} ends past the end of the file`);
      const count = shape.reduce((a, b) => a * b, 1);
      if (end - start !== count * width!)
        fail(`${name} has ${(end - start) / width!} values for shape [${shape}]`);
      const rowLength = shape.slice(1).reduce((a, b) => a * b, 1);
      tensors.set(name, {
        dtype: dtype as Dtype,
        shape,
        read: async (r0, r1) => {
          const raw = Buffer.alloc((r1 - r0) * rowLength * width!);
          await file.read(raw, 0, raw.length, base + start + r0 * rowLength * width!);
          return decode(raw, dtype, `${name} of ${path}`);
        },
      });
    }
    return { tensors, close: () => file.close() };
  } catch (err) {
    await file.close();
    throw err;
  }
}

const DTYPE_BYTES: Record<string, number> = { F32: 4, BF16: 2, F16: 2 };

function decode(raw: Uint8Array, dtype: string, name: string, into?: Float32Array): Float32Array {
  const view = new DataView(raw.buffer, raw.byteOffset, raw.byteLength);
  const width = DTYPE_BYTES[dtype];
  if (width === undefined)
    throw new SafetensorsError(`unsupported dtype ${dtype} for ${name}`, name);
  const out = into ?? new Float32Array(raw.byteLength / width);
  if (out.length !== raw.byteLength / width) {
    throw new Error(`safetensors: ${name} has ${raw.byteLength / width} values, not ${out.length}`);
  }
  if (dtype === "F32") {
    for (let i = 0; i < out.length; i++) out[i] = view.getFloat32(i * 4, true);
  } else if (dtype === "BF16") {
    const bits = new Uint32Array(out.buffer, out.byteOffset, out.length);
    for (let i = 0; i < out.length; i++) bits[i] = view.getUint16(i * 2, true) << 16;
  } else {
    for (let i = 0; i < out.length; i++) out[i] = halfToFloat(view.getUint16(i * 2, true));
  }
  return out;
}

function halfToFloat(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exponent = (h >> 10) & 0x1f;
  const fraction = h & 0x3ff;
  if (exponent === 0) return sign * 2 ** -14 * (fraction / 1024);
  if (exponent === 31) return fraction ? Number.NaN : sign * Number.POSITIVE_INFINITY;
  return sign * 2 ** (exponent - 15) * (1 + fraction / 1024);
}

/** Writes tensors as F32 (or BF16, rounded to nearest even), in name order, each 8-byte aligned
 * as the format recommends. */
export function saveSafetensors(
  tensors: Map<string, { shape: number[]; data: Weight }>,
  metadata: Record<string, string> = {},
  dtype: "F32" | "BF16" = "F32",
): Uint8Array {
  const width = dtype === "F32" ? 4 : 2;
  const names = [...tensors.keys()].sort();
  const header: Record<string, unknown> = {};
  if (Object.keys(metadata).length > 0) header["__metadata__"] = metadata;
  let offset = 0;
  for (const name of names) {
    const tensor = tensors.get(name)!;
    const size = tensor.shape.reduce((a, b) => a * b, 1);
    if (size !== tensor.data.length) throw new Error(`safetensors: ${name} shape/data mismatch`);
    header[name] = { dtype, shape: tensor.shape, data_offsets: [offset, offset + size * width] };
    offset += size * width;
  }
  let headerText = JSON.stringify(header);
  while ((8 + headerText.length) % 8 !== 0) headerText += " ";
  const headerBytes = new TextEncoder().encode(headerText);
  const out = new Uint8Array(8 + headerBytes.length + offset);
  const view = new DataView(out.buffer);
  view.setBigUint64(0, BigInt(headerBytes.length), true);
  out.set(headerBytes, 8);
  let position = 8 + headerBytes.length;
  const bits = new Uint32Array(1);
  const float = new Float32Array(bits.buffer);
  for (const name of names) {
    // A packed weight is read one tensor at a time, never the whole model beside the output.
    const data = weightArray(tensors.get(name)!.data);
    if (dtype === "F32") {
      for (let i = 0; i < data.length; i++) view.setFloat32(position + i * 4, data[i]!, true);
    } else {
      for (let i = 0; i < data.length; i++) {
        float[0] = data[i]!;
        const b = bits[0]!;
        view.setUint16(position + i * 2, (b + 0x7fff + ((b >>> 16) & 1)) >>> 16, true);
      }
    }
    position += data.length * width;
  }
  return out;
}
