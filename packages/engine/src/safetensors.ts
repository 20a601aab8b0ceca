/** Minimal safetensors reader/writer: 8-byte LE header length, JSON header, raw little-endian data. */
import { open } from "node:fs/promises";
import { type Weight, weightArray } from "./weights.ts";

export type Dtype = "F32" | "F16" | "BF16";

export interface NamedTensor {
  shape: number[];
  data: Float32Array;
}

export type TensorMap = Map<string, NamedTensor>;

export function readSafetensors(bytes: Uint8Array): {
  tensors: TensorMap;
  metadata: Record<string, string>;
} {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  if (bytes.byteLength < 8) throw new Error("safetensors: truncated (no header)");
  const headerLength = Number(view.getBigUint64(0, true));
  if (8 + headerLength > bytes.byteLength) {
    throw new Error("safetensors: truncated (the header runs past the end)");
  }
  let header: Record<string, unknown>;
  try {
    header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + headerLength)));
  } catch {
    throw new Error("safetensors: the header is not JSON");
  }
  if (typeof header !== "object" || header === null || Array.isArray(header)) {
    throw new Error("safetensors: the header is not a JSON object");
  }
  const base = 8 + headerLength;
  const tensors: TensorMap = new Map();
  let metadata: Record<string, string> = {};
  for (const [name, entry] of Object.entries(header)) {
    if (name === "__metadata__") {
      metadata = entry as Record<string, string>;
      continue;
    }
    const { dtype, shape, data_offsets } = entry as {
      dtype: string;
      shape: number[];
      data_offsets: [number, number];
    };
    const size = DTYPE_BYTES[dtype];
    if (size === undefined) throw new Error(`safetensors: unsupported dtype ${dtype} for ${name}`);
    const [start, end] = Array.isArray(data_offsets) ? data_offsets : [];
    const count = Array.isArray(shape) ? shape.reduce((a, b) => a * b, 1) : Number.NaN;
    if (
      !Number.isSafeInteger(start) ||
      !Number.isSafeInteger(end) ||
      start! < 0 ||
      end! - start! !== count * size
    ) {
      throw new Error(`safetensors: ${name}'s data_offsets do not fit its shape and dtype`);
    }
    if (base + end! > bytes.byteLength) {
      throw new Error(`safetensors: truncated (${name} ends past the end of the file)`);
    }
    const raw = bytes.subarray(base + start!, base + end!);
    tensors.set(name, { shape, data: decode(raw, dtype, name) });
  }
  return { tensors, metadata };
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

function decode(raw: Uint8Array, dtype: string, name: string): Float32Array {
  const view = new DataView(raw.buffer, raw.byteOffset, raw.byteLength);
  if (dtype === "F32") {
    const out = new Float32Array(raw.byteLength / 4);
    for (let i = 0; i < out.length; i++) out[i] = view.getFloat32(i * 4, true);
    return out;
  }
  if (dtype === "BF16") {
    const out = new Float32Array(raw.byteLength / 2);
    const bits = new Uint32Array(out.buffer);
    for (let i = 0; i < out.length; i++) bits[i] = view.getUint16(i * 2, true) << 16;
    return out;
  }
  if (dtype === "F16") {
    const out = new Float32Array(raw.byteLength / 2);
    for (let i = 0; i < out.length; i++) out[i] = halfToFloat(view.getUint16(i * 2, true));
    return out;
  }
  throw new Error(`safetensors: unsupported dtype ${dtype} for ${name}`);
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
