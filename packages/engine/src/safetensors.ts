/** Minimal safetensors reader/writer: 8-byte LE header length, JSON header, raw little-endian data. */

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
  const headerLength = Number(view.getBigUint64(0, true));
  const header = JSON.parse(
    new TextDecoder().decode(bytes.subarray(8, 8 + headerLength)),
  ) as Record<string, unknown>;
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
    const [start, end] = data_offsets;
    const raw = bytes.subarray(base + start, base + end);
    tensors.set(name, { shape, data: decode(raw, dtype, name) });
  }
  return { tensors, metadata };
}

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

/** Writes F32 tensors, in name order, each 8-byte aligned as the format recommends. */
export function saveSafetensors(
  tensors: TensorMap,
  metadata: Record<string, string> = {},
): Uint8Array {
  const names = [...tensors.keys()].sort();
  const header: Record<string, unknown> = {};
  if (Object.keys(metadata).length > 0) header["__metadata__"] = metadata;
  let offset = 0;
  for (const name of names) {
    const tensor = tensors.get(name)!;
    const size = tensor.shape.reduce((a, b) => a * b, 1);
    if (size !== tensor.data.length) throw new Error(`safetensors: ${name} shape/data mismatch`);
    header[name] = { dtype: "F32", shape: tensor.shape, data_offsets: [offset, offset + size * 4] };
    offset += size * 4;
  }
  let headerText = JSON.stringify(header);
  while ((8 + headerText.length) % 8 !== 0) headerText += " ";
  const headerBytes = new TextEncoder().encode(headerText);
  const out = new Uint8Array(8 + headerBytes.length + offset);
  const view = new DataView(out.buffer);
  view.setBigUint64(0, BigInt(headerBytes.length), true);
  out.set(headerBytes, 8);
  let position = 8 + headerBytes.length;
  for (const name of names) {
    const { data } = tensors.get(name)!;
    for (let i = 0; i < data.length; i++) view.setFloat32(position + i * 4, data[i]!, true);
    position += data.length * 4;
  }
  return out;
}
