/**
 * For the benches only: rewrites an F32 GGUF (the engine's own export) as llama.cpp's Q8_0 —
 * every 2-D tensor whose rows are whole blocks of 32 in ggml's Q8_0 (per 32 values an F16
 * scale d = max|x| / 127 and 32 int8 round(x / d), as `quantize_row_q8_0_ref`), the rest F32,
 * the metadata copied (its file type set to MOSTLY_Q8_0). A tensor at a time, never the whole
 * file in memory.
 */
import { closeSync, openSync, readSync, writeSync } from "node:fs";

const GGML_F32 = 0;
const GGML_Q8_0 = 8;
const MOSTLY_Q8_0 = 7;

interface TensorInfo {
  name: string;
  dims: bigint[];
  type: number;
  offset: bigint;
}

class Reader {
  pos = 0;
  readonly view: DataView;
  constructor(view: DataView) {
    this.view = view;
  }
  u32() {
    const v = this.view.getUint32(this.pos, true);
    this.pos += 4;
    return v;
  }
  u64() {
    const v = this.view.getBigUint64(this.pos, true);
    this.pos += 8;
    return v;
  }
  string() {
    const n = Number(this.u64());
    const s = Buffer.from(this.view.buffer, this.view.byteOffset + this.pos, n).toString("utf8");
    this.pos += n;
    return s;
  }
  /** Skips a value of GGUF type `type`. */
  skip(type: number): void {
    const sizes: Record<number, number> = {
      0: 1,
      1: 1,
      2: 2,
      3: 2,
      4: 4,
      5: 4,
      6: 4,
      7: 1,
      10: 8,
      11: 8,
      12: 8,
    };
    if (type === 8) this.string();
    else if (type === 9) {
      const inner = this.u32();
      const count = Number(this.u64());
      if (sizes[inner] !== undefined) this.pos += sizes[inner] * count;
      else for (let i = 0; i < count; i++) this.skip(inner);
    } else this.pos += sizes[type]!;
  }
}

/** Q8_0 blocks of `values` (a multiple of 32). */
function quantizeQ8_0(values: Float32Array): Uint8Array {
  const blocks = values.length / 32;
  const out = new Uint8Array(blocks * 34);
  const view = new DataView(out.buffer);
  for (let b = 0; b < blocks; b++) {
    let max = 0;
    for (let i = 0; i < 32; i++) max = Math.max(max, Math.abs(values[b * 32 + i]!));
    const d = max / 127;
    const id = d ? 1 / d : 0;
    view.setFloat16(b * 34, d, true);
    for (let i = 0; i < 32; i++) view.setInt8(b * 34 + 2 + i, Math.round(values[b * 32 + i]! * id));
  }
  return out;
}

/** Writes `source` (an F32 GGUF) as a Q8_0 GGUF at `target`. */
export function requantizeGgufQ8_0(source: string, target: string): void {
  const fd = openSync(source, "r");
  // The header (metadata and tensor infos) is small: read the first 64 MB (or the whole file).
  const head = Buffer.alloc(64 << 20);
  const got = readSync(fd, head, 0, head.length, 0);
  const r = new Reader(new DataView(head.buffer, head.byteOffset, got));
  if (r.u32() !== 0x46554747) throw new Error(`${source}: not a GGUF file`);
  const version = r.u32();
  const tensorCount = Number(r.u64());
  const kvCount = Number(r.u64());
  let alignment = 32;
  let fileTypeAt = -1;
  for (let i = 0; i < kvCount; i++) {
    const key = r.string();
    const type = r.u32();
    if (key === "general.alignment") alignment = r.view.getUint32(r.pos, true);
    if (key === "general.file_type" && type === 4) fileTypeAt = r.pos;
    r.skip(type);
  }
  const metaEnd = r.pos;
  const tensors: TensorInfo[] = [];
  for (let i = 0; i < tensorCount; i++) {
    const name = r.string();
    const n = r.u32();
    const dims = Array.from({ length: n }, () => r.u64());
    tensors.push({ name, dims, type: r.u32(), offset: r.u64() });
  }
  const align = (n: number) => Math.ceil(n / alignment) * alignment;
  const dataStart = align(r.pos);
  // New types and offsets.
  const out: { info: TensorInfo; type: number; bytes: number; offset: number }[] = [];
  let offset = 0;
  for (const info of tensors) {
    if (info.type !== GGML_F32) throw new Error(`${source}: ${info.name} is not F32`);
    const count = info.dims.reduce((a, b) => a * Number(b), 1);
    const q = info.dims.length === 2 && Number(info.dims[0]) % 32 === 0;
    const bytes = q ? (count / 32) * 34 : count * 4;
    out.push({ info, type: q ? GGML_Q8_0 : GGML_F32, bytes, offset });
    offset = align(offset + bytes);
  }
  const header: Buffer[] = [];
  const meta = Buffer.from(head.subarray(0, metaEnd));
  meta.writeUInt32LE(version, 4);
  if (fileTypeAt >= 0) meta.writeUInt32LE(MOSTLY_Q8_0, fileTypeAt);
  header.push(meta);
  for (const { info, type, offset: at } of out) {
    const name = Buffer.from(info.name, "utf8");
    const b = Buffer.alloc(8 + name.length + 4 + 8 * info.dims.length + 4 + 8);
    let p = b.writeBigUInt64LE(BigInt(name.length), 0);
    p += name.copy(b, p);
    p = b.writeUInt32LE(info.dims.length, p);
    for (const d of info.dims) p = b.writeBigUInt64LE(d, p);
    p = b.writeUInt32LE(type, p);
    b.writeBigUInt64LE(BigInt(at), p);
    header.push(b);
  }
  const headerBytes = Buffer.concat(header);
  const newDataStart = align(headerBytes.length);
  const wd = openSync(target, "w");
  writeSync(wd, headerBytes, 0, headerBytes.length, 0);
  writeSync(
    wd,
    Buffer.alloc(newDataStart - headerBytes.length),
    0,
    newDataStart - headerBytes.length,
    headerBytes.length,
  );
  for (const { info, type, bytes, offset: at } of out) {
    const count = info.dims.reduce((a, b) => a * Number(b), 1);
    const raw = Buffer.alloc(count * 4);
    readSync(fd, raw, 0, raw.length, dataStart + Number(info.offset));
    const values = new Float32Array(raw.buffer, raw.byteOffset, count);
    const data =
      type === GGML_Q8_0 ? quantizeQ8_0(values) : new Uint8Array(raw.buffer, raw.byteOffset, bytes);
    const padded = align(bytes) - bytes;
    writeSync(wd, data, 0, data.length, newDataStart + at);
    if (padded) writeSync(wd, Buffer.alloc(padded), 0, padded, newDataStart + at + bytes);
  }
  closeSync(wd);
  closeSync(fd);
}
