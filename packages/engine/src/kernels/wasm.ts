/// <reference path="./wasm/webassembly.d.ts" />
import { readFileSync } from "node:fs";
import { totalmem } from "node:os";
import { jsKernels } from "./js.ts";
import { dequantizeQ8Rows, q8Bytes, q8Fits, q8QuadStride, quantizeQ8Rows } from "./q8.ts";
import { invoke, type KernelArgs, type KernelExports, type KernelName } from "./table.ts";
import type { Kernels, PackedWeight, WeightDtype, Workspace } from "./types.ts";
import { ArenaAllocator, align, MAX_PAGES, MAX_PAGES_64, PAGE } from "./wasm/arena.ts";
import {
  attentionBackwardJob,
  attentionStackedJob,
  call,
  gemmAtJob,
  type Job,
  runJob,
} from "./wasm/jobs.ts";
import { MAX_TASKS, ThreadPool } from "./wasm/pool.ts";
import { isWeightSource, type WeightSource } from "./weight.ts";

interface Packed {
  offset: number;
  bytes: number;
  version: number;
  N: number;
}

/** The most bytes a wasm32 kernel arena holds: 4 GiB. */
export const ARENA_LIMIT = MAX_PAGES * PAGE;
/** The most bytes a Memory64 kernel arena holds: 16 GiB. */
export const ARENA_LIMIT_64 = MAX_PAGES_64 * PAGE;

/**
 * What a Memory64 arena may grow to by default: 16 GiB, or three quarters of the memory this
 * process may use (the machine's, or its container's limit) when that is less; the rest is the
 * process's own and the system's.
 */
export function memory64Limit(): number {
  const constrained = process.constrainedMemory();
  const memory = constrained > 0 ? Math.min(constrained, totalmem()) : totalmem();
  return Math.min(ARENA_LIMIT_64, Math.floor((memory * 0.75) / PAGE) * PAGE);
}

/** The most a model may take of the engine's memory: a wasm32 arena's, or a Memory64 one's. */
export function engineMemoryLimit(): number {
  return Math.max(ARENA_LIMIT, memory64Limit());
}
/**
 * From this many rows on, a GEMM on BF16 panels widens them to F32 a slab at a time and runs the
 * F32 kernel (widening in every tile costs about a third more at 128 rows; at decode, reading
 * half the bytes wins).
 */
const BF16_WIDEN_ROWS = 16;
/** `WasmKernels.bSlabBytes` by default. */
export const B_SLAB_BYTES = 32 << 20;
/** Largest slice of a weight copied into the arena at a time to be packed. */
export const PACK_SLICE = 8 << 20;

/** Rows of a [rows, cols] weight packed at a time: whole 8-row panels, about PACK_SLICE bytes. */
export function packSliceRows(cols: number): number {
  return Math.max(8, Math.floor(PACK_SLICE / (cols * 4 * 8)) * 8);
}

/**
 * WebAssembly SIMD kernels over one WebAssembly.Memory arena. Weight operands passed with a
 * version are copied into the arena once and reused until the version changes; other operands
 * go through a scratch area above the weights. Views are re-made per call, so growing is safe.
 */
export class WasmKernels implements Kernels {
  readonly name: string;
  readonly memory: WebAssembly.Memory;
  readonly memoryLimit: number;
  /** The most bytes of the arena that were in use at once. */
  peakBytes = 0;
  private readonly exports: KernelExports;
  private readonly packedW = new WeakMap<Float32Array, Packed>();
  private readonly mirrors = new WeakMap<Float32Array, { offset: number; synced: number }>();
  /** Arrays made by `array`, live until `freeArray` or collected. */
  private readonly arrays = new WeakSet<Float32Array>();
  /** Allocations in the arena; scratch for one call lives above `heap.top`. */
  private readonly heap = new ArenaAllocator(64);
  /** The SharedArrayBuffers (one per memory size) that arena views were made on. */
  private readonly arenaBuffers = new WeakSet<object>();
  /**
   * Rows of a weight-gradient GEMM per pass: 256 keeps both operands' rows in L2 (measured
   * 44–49 GFLOP/s on the tiny-chat shapes at 128–512 rows, 30–41 in one pass over 4,096).
   */
  tnChunk = 256;
  /**
   * Most bytes of B-panels made at once from a weight packed here (dX = dY·W in a backward):
   * larger weights (the head's V rows) are done in slabs of rows, so the scratch a backward
   * needs stays small (`trainingMemory`'s `fixed`).
   */
  bSlabBytes = B_SLAB_BYTES;
  /** Arena blocks of weights and caches whose arrays were garbage-collected go back to the heap. */
  private readonly reclaim = new FinalizationRegistry<{ offset: number; size: number }>(
    ({ offset, size }) => this.heap.free(offset, size),
  );

  /** Threads that share each large kernel call (1 = this thread only). */
  readonly threads: number;
  /** Kernel calls so far that were split among threads. */
  splitCalls = 0;
  private pool: ThreadPool | null;

  /** Whether the arena is a Memory64 one (the kernels then take their integers as f64). */
  readonly memory64: boolean;

  constructor(bytes: Uint8Array, name: string, options: WasmKernelOptions = {}) {
    this.name = name;
    this.threads = Math.min(MAX_THREADS, Math.max(1, Math.floor(options.threads ?? 1)));
    this.memory64 = options.memory64 ?? false;
    const limit = options.memoryLimit ?? (this.memory64 ? memory64Limit() : ARENA_LIMIT);
    const pages = Math.min(
      this.memory64 ? MAX_PAGES_64 : MAX_PAGES,
      Math.max(256, Math.floor(limit / PAGE)),
    );
    this.memoryLimit = pages * PAGE;
    this.memory = this.memory64
      ? new WebAssembly.Memory({
          initial: 256n,
          maximum: BigInt(pages),
          shared: true,
          address: "i64",
        })
      : new WebAssembly.Memory({ initial: 256, maximum: pages, shared: true });
    const module = new WebAssembly.Module(bytes);
    const instance = new WebAssembly.Instance(module, { env: { memory: this.memory } });
    this.exports = instance.exports as unknown as KernelExports;
    this.pool = this.threads > 1 ? new ThreadPool(module, this.memory, this.threads - 1) : null;
  }

  /**
   * Stops the helper threads (they are unref'd: needed only to free them early); later calls
   * run on the calling thread alone.
   */
  async close(): Promise<void> {
    const pool = this.pool;
    this.pool = null;
    await pool?.close();
  }

  /** Runs tasks on this thread and the helpers, and returns when all are done. */
  private runJobs(jobs: Job[]): void {
    if (!this.pool || jobs.length === 1) {
      for (const job of jobs) runJob(this.exports, job.op, job.args);
      return;
    }
    this.splitCalls++;
    this.pool.run(this.exports, jobs);
  }

  /**
   * How many tasks a call of `flops` work is cut into: small calls stay whole on this thread;
   * larger ones get several tasks per thread, claimed as threads come free, so a thread that
   * is slow or not scheduled holds up little.
   */
  private parts(flops: number): number {
    if (!this.pool || flops < PARALLEL_FLOPS) return 1;
    const perThread = Math.min(
      MAX_TASKS_PER_THREAD,
      Math.max(1, Math.floor(flops / FLOPS_PER_TASK)),
    );
    return Math.min(MAX_TASKS, this.threads * perThread);
  }

  private ensure(bytes: number): void {
    if (bytes > this.peakBytes) this.peakBytes = bytes;
    const need = bytes - this.memory.buffer.byteLength;
    if (need <= 0) return;
    const pages = Math.ceil(need / PAGE);
    this.memory.grow(this.memory64 ? BigInt(pages) : pages);
  }

  /** An arena block of `bytes` that lives as long as `owner`. */
  private slot(owner: object, bytes: number, token?: object): number {
    const offset = this.allocate(bytes);
    this.reclaim.register(owner, { offset, size: bytes }, token);
    return offset;
  }

  /** An arena block of `bytes`, the memory grown to hold it; nothing is kept when growing fails. */
  private allocate(bytes: number): number {
    const offset = this.heap.alloc(bytes);
    try {
      this.ensure(this.heap.top);
    } catch (err) {
      this.heap.free(offset, bytes);
      throw err;
    }
    return offset;
  }

  /** A view of arena floats, recognised later as already in the arena (no copies). */
  private view(offset: number, n: number): Float32Array {
    const buffer = this.memory.buffer;
    this.arenaBuffers.add(buffer);
    return new Float32Array(buffer, offset, n);
  }

  /** Byte offset of `a` in the arena, or −1 when it lives elsewhere. */
  private offsetOf(a: Float32Array): number {
    return this.arenaBuffers.has(a.buffer) ? a.byteOffset : -1;
  }

  /** An output operand for `stage`: the array itself when it is in the arena, else scratch. */
  private output(a: Float32Array, n: number): Float32Array | number {
    return this.offsetOf(a) >= 0 ? a.subarray(0, n) : n;
  }

  /** Copies n floats at `offset` into `out`, unless `out` is that very arena range. */
  private copyOut(out: Float32Array, offset: number, n: number): void {
    if (this.offsetOf(out) === offset) return;
    out.set(new Float32Array(this.memory.buffer, offset, n));
  }

  /** Bytes of the arena held now by weights, caches and workspaces (for tests and diagnostics). */
  get usedBytes(): number {
    return this.heap.used;
  }

  array(n: number): Float32Array {
    const size = n * 4;
    const offset = this.allocate(size);
    const view = this.view(offset, n);
    view.fill(0);
    this.arrays.add(view);
    this.reclaim.register(view, { offset, size }, view);
    return view;
  }

  freeArray(a: Float32Array): void {
    if (!this.arrays.delete(a)) throw new Error("freeArray: not an array of these kernels");
    this.reclaim.unregister(a);
    this.heap.free(a.byteOffset, a.length * 4);
  }

  /**
   * Float32Arrays allocated in the arena, zeroed, valid until `release()`: kernel calls on
   * them read and write in place instead of copying through scratch.
   */
  workspace(): Workspace {
    const blocks: [number, number][] = [];
    return {
      f32: (n: number) => {
        const offset = this.allocate(n * 4);
        blocks.push([offset, n * 4]);
        const view = this.view(offset, n);
        view.fill(0);
        return view;
      },
      release: () => {
        for (const [offset, bytes] of blocks) this.heap.free(offset, bytes);
        blocks.length = 0;
      },
    };
  }

  /**
   * A [rows, cols] weight kept packed in the arena as W-panels (`Wᵀ`, 8 rows per panel, zero
   * past the last row): the model's only copy of it, freed when the returned object is
   * collected. Fill it with `writeRows`; `readRows` unpacks rows back (export, merging).
   */
  packWeight(rows: number, cols: number, dtype: WeightDtype): PackedWeight {
    if (dtype === "q8" && !q8Fits(rows, cols)) dtype = "bf16";
    const bytes =
      dtype === "q8"
        ? q8Bytes(rows, cols)
        : dtype === "bf16"
          ? panelBytes(rows, cols) / 2
          : panelBytes(rows, cols);
    const weight = new ArenaWeight(this, 0, rows, cols, dtype, bytes);
    weight.offset = this.slot(weight, bytes, weight);
    return weight;
  }

  /** Frees a packed weight's block now (`PackedWeight.release`). */
  releasePacked(weight: ArenaWeight): void {
    this.reclaim.unregister(weight);
    this.heap.free(weight.offset, weight.bytes);
  }

  /** Packs rows [r0, r0 + n) of `weight` from row-major `data` (r0 a multiple of 8). */
  writePacked(weight: ArenaWeight, r0: number, data: Float32Array): void {
    const K = weight.cols;
    const n = data.length / K;
    if (r0 % 8 !== 0 || !Number.isInteger(n) || r0 + n > weight.rows) {
      throw new Error(
        `kernels: rows ${r0}..${r0 + n} do not fit a [${weight.rows}, ${weight.cols}] weight`,
      );
    }
    if (weight.dtype === "q8") {
      // Quantized here, straight into its blocks (a few ms per million weights).
      quantizeQ8Rows(new Uint8Array(this.memory.buffer, weight.offset, weight.bytes), K, r0, data);
      return;
    }
    if (weight.dtype === "f32") {
      this.packInto(weight.offset + (r0 / 8) * K * 32, data, "w", n, K, this.heap.top);
      return;
    }
    // BF16: packed in F32 in scratch, then narrowed into place (panels keep their order).
    const scratch = this.heap.top;
    const floats = panelBytes(n, K) / 4;
    this.packInto(scratch, data, "w", n, K, scratch + align(floats * 4));
    invoke(this.exports, "narrow_bf16", {
      dst: weight.offset + (r0 / 8) * K * 16,
      src: scratch,
      n: floats,
    });
  }

  /** Rows [r0, r1) of a packed weight, unpacked to row-major F32. */
  readPacked(weight: ArenaWeight, r0: number, r1: number, out?: Float32Array): Float32Array {
    const K = weight.cols;
    const result = out ?? new Float32Array((r1 - r0) * K);
    if (weight.dtype === "q8") {
      const bytes = new Uint8Array(this.memory.buffer, weight.offset, weight.bytes);
      return dequantizeQ8Rows(bytes, K, r0, r1, result);
    }
    if (weight.dtype === "bf16") {
      const bits = new Uint32Array(result.buffer, result.byteOffset, result.length);
      const arena = new Uint16Array(this.memory.buffer);
      const base = weight.offset / 2;
      for (let r = r0; r < r1; r++) {
        let at = base + (r >> 3) * K * 8 + BF16_LANE[r & 7]!;
        const o = (r - r0) * K;
        for (let k = 0; k < K; k++, at += 8) bits[o + k] = arena[at]! << 16;
      }
      return result;
    }
    const arena = new Float32Array(this.memory.buffer);
    const base = weight.offset / 4;
    for (let r = r0; r < r1; r++) {
      let at = base + (r >> 3) * K * 8 + (r & 7);
      const o = (r - r0) * K;
      for (let k = 0; k < K; k++, at += 8) result[o + k] = arena[at]!;
    }
    return result;
  }

  /**
   * Packs a weight W[N,K] kept here as W-panels into B-panels of B = W ([N rows][K columns],
   * for dX = dY·W) at `dst`: each 8×8 block of a W-panel, transposed.
   */
  private weightToB(dst: number, weight: ArenaWeight, n0 = 0, n1 = weight.rows): void {
    const K = weight.cols;
    const N = n1 - n0;
    this.ensure(dst + panelBytes(K, N));
    if (weight.dtype === "q8") {
      // Dequantized by the kernel: rows n0… (a multiple of 8) are whole quads, K whole blocks.
      invoke(this.exports, "q8_to_b", {
        dst,
        src: weight.offset + (n0 / 4) * q8QuadStride(K),
        quads: N / 4,
        nb: K / 32,
        N,
      });
      return;
    }
    // F32 bits either way: a BF16 number is the top half of its F32.
    const out32 = new Uint32Array(this.memory.buffer);
    const bf16 = weight.dtype === "bf16";
    const arena = bf16 ? new Uint16Array(this.memory.buffer) : out32;
    const shift = bf16 ? 16 : 0;
    const src = weight.offset / (bf16 ? 2 : 4);
    const out = dst / 4;
    const K8 = Math.ceil(K / 8);
    // Rows n0… of W (n0 a multiple of 8) become rows 0… of the B-panels: the whole 8×8 blocks
    // by the kernel, a partial panel or block of k here.
    const whole = Math.floor(N / 8);
    const blocks = Math.floor(K / 8);
    const first = weight.offset + (n0 / 8) * K * (bf16 ? 16 : 32);
    invoke(this.exports, bf16 ? "weight_to_b_bf16" : "weight_to_b", {
      dst,
      src: first,
      panels: whole,
      blocks,
      K,
      N,
    });
    for (let p = 0; p < Math.ceil(N / 8); p++) {
      const rows = Math.min(8, N - p * 8);
      const panel = src + (n0 / 8 + p) * K * 8;
      for (let j = p < whole ? blocks : 0; j < K8; j++) {
        const cols = Math.min(8, K - j * 8);
        const from = panel + j * 64;
        const to = out + j * N * 8 + p * 64;
        for (let r = 0; r < rows; r++) {
          const o = to + r * 8;
          const lane = bf16 ? BF16_LANE[r]! : r;
          for (let c = 0; c < cols; c++) out32[o + c] = arena[from + c * 8 + lane]! << shift;
          for (let c = cols; c < 8; c++) out32[o + c] = 0;
        }
      }
    }
  }

  /**
   * Arena offset of a Linear weight W[N,K] packed into GEMM panels as Wᵀ, packed when first
   * seen and again when its version changes.
   */
  private packedWeight(array: Float32Array, version: number, N: number, K: number): number {
    let cached = this.packedW.get(array);
    if (cached && cached.version === version && cached.N === N) return cached.offset;
    if (!cached || cached.N !== N) {
      if (cached) {
        // Re-shaped: free the old block now rather than when the array is collected.
        this.reclaim.unregister(cached);
        this.heap.free(cached.offset, cached.bytes);
      }
      const bytes = panelBytes(N, K);
      cached = { offset: 0, bytes, version, N };
      cached.offset = this.slot(array, bytes, cached);
      this.packedW.set(array, cached);
    }
    cached.version = version;
    this.packInto(cached.offset, array, "w", N, K, this.heap.top);
    return cached.offset;
  }

  /**
   * Packs `src` into panels at `dst`, copying it to scratch at `scratch` a slice at a time (at
   * most PACK_SLICE bytes), so packing a weight never needs a whole unpacked copy in the arena:
   * `w` slices whole rows of W[N,K] (8 panel columns each), `b` whole rows of B[K,N].
   */
  private packInto(
    dst: number,
    src: Float32Array,
    layout: "w" | "b",
    N: number,
    K: number,
    scratch: number,
  ): void {
    const ps = K * 32;
    if (layout === "w") {
      const rows = packSliceRows(K);
      this.ensure(scratch + Math.min(rows, N) * K * 4);
      for (let n0 = 0; n0 < N; n0 += rows) {
        const n = Math.min(rows, N - n0);
        new Float32Array(this.memory.buffer, scratch, n * K).set(
          src.subarray(n0 * K, (n0 + n) * K),
        );
        invoke(this.exports, "pack_w", { dst: dst + (n0 / 8) * ps, src: scratch, N: n, K, ps });
      }
    } else {
      const rows = Math.max(1, Math.floor(PACK_SLICE / (N * 4)));
      this.ensure(scratch + Math.min(rows, K) * N * 4);
      for (let k0 = 0; k0 < K; k0 += rows) {
        const k = Math.min(rows, K - k0);
        new Float32Array(this.memory.buffer, scratch, k * N).set(
          src.subarray(k0 * N, (k0 + k) * N),
        );
        invoke(this.exports, "pack_b", { dst: dst + k0 * 32, src: scratch, N, K: k, ps });
      }
    }
  }

  /**
   * Arena offset of a mirror of an append-only cache array, synced up to `valid` floats.
   * Rows before `fresh` are assumed unchanged since the last sync (a cache only appends, or is
   * rewound; a refill from position 0 resets the mirror, see `attention`).
   */
  private mirror(array: Float32Array, fresh: number, valid: number): number {
    let entry = this.mirrors.get(array);
    if (!entry) {
      entry = { offset: this.slot(array, array.length * 4), synced: 0 };
      this.mirrors.set(array, entry);
    }
    const from = Math.min(entry.synced, fresh);
    new Float32Array(this.memory.buffer, entry.offset + from * 4, valid - from).set(
      array.subarray(from, valid),
    );
    entry.synced = valid;
    return entry.offset;
  }

  /**
   * out[M,N] (+)= A·B with B in panels: `b` is a weight (packed once per version) or is packed
   * into scratch. A is [M,K] (`transposedA`: [K,M]). Output rows are padded to whole panels
   * in the arena and copied back.
   */
  private gemm(
    out: Float32Array,
    a: Float32Array,
    weight: Float32Array | WeightSource,
    layout: "w" | "b",
    M: number,
    N: number,
    K: number,
    accumulate: boolean,
    bVersion: number | undefined,
    transposedA: boolean,
  ): void {
    // A weight packed here (its only copy) is used where it lies; another source is read whole.
    const own = weight instanceof ArenaWeight && weight.kernels === this ? weight : null;
    own?.live();
    if (own?.dtype === "q8" && layout === "w" && !transposedA) {
      this.gemmsQ8([out], a, [own], M, [N], K, accumulate);
      return;
    }
    const b = own ?? (isWeightSource(weight) ? weight.readRows(0, weight.rows) : weight);
    // Only a weight's W[N,K] panels are kept. Its B[K,N] panels (a backward's dX = dY·W) are
    // packed per call: one pass over the weight against M·N·K work, and keeping them would
    // hold a second packed copy of the model in the arena.
    const keep =
      layout === "w" && (own !== null || (bVersion !== undefined && !isWeightSource(weight)));
    let panels: number;
    if (own && layout === "w") panels = own.offset;
    else if (keep) panels = this.packedWeight(b as Float32Array, bVersion!, N, K);
    // The forward reads a BF16 weight's own panels; everything else is F32.
    const bf16 = own !== null && layout === "w" && own.dtype === "bf16";
    let top = this.heap.top;
    // A weight packed here gives its B-panels a slab of K rows at a time (at most
    // `bSlabBytes`), each slab's product added onto the last: every sum runs over k in order
    // (the accumulators go through `out` between slabs), so the bits are those of one pass.
    let slab = K;
    if (!keep) {
      panels = top;
      if (own) {
        const perRow = Math.ceil(N / 8) * 32;
        slab = Math.min(K, Math.max(8, Math.floor(this.bSlabBytes / perRow / 8) * 8));
        top += align(panelBytes(N, slab));
      } else {
        top += align(panelBytes(N, K));
        this.packInto(panels, b as Float32Array, layout, N, K, top);
      }
    }
    // Operands already in the arena (workspace arrays) are used in place; others are copied.
    const N8 = Math.ceil(N / 8) * 8;
    let aOffset = this.offsetOf(a);
    if (aOffset < 0) {
      aOffset = top;
      top += align(M * K * 4);
    }
    let outOffset = N8 === N ? this.offsetOf(out) : -1;
    const outInPlace = outOffset >= 0;
    if (!outInPlace) {
      outOffset = top;
      top += align(M * N8 * 4);
    }
    this.ensure(top);
    const buffer = this.memory.buffer;
    if (aOffset !== this.offsetOf(a))
      new Float32Array(buffer, aOffset, M * K).set(a.subarray(0, M * K));
    const outView = new Float32Array(buffer, outOffset, M * N8);
    if (accumulate && !outInPlace) copyRows(outView, N8, out, N, M);
    const lda = transposedA ? M * 4 : K * 4;
    const ldo = N8 * 4;
    if (bf16 && M >= BF16_WIDEN_ROWS) {
      // Many rows: widen the weight to F32 panels a slab of columns at a time (in scratch above
      // the operands) and run the F32 kernel on each, which sums exactly as gemm_bf16 does.
      const perPanel = K * 32;
      const panelsPerSlab = Math.max(1, Math.floor(this.bSlabBytes / perPanel));
      const scratch = top;
      this.ensure(scratch + Math.min(Math.ceil(N / 8), panelsPerSlab) * perPanel);
      for (let p0 = 0; p0 < Math.ceil(N / 8); p0 += panelsPerSlab) {
        const p1 = Math.min(Math.ceil(N / 8), p0 + panelsPerSlab);
        invoke(this.exports, "widen_bf16", {
          dst: scratch,
          src: own!.offset + p0 * K * 16,
          n: (p1 - p0) * K * 8,
        });
        const n0 = p0 * 8;
        this.gemmJobs(
          outOffset + n0 * 4,
          ldo,
          aOffset,
          lda,
          scratch,
          M,
          Math.min(N, p1 * 8) - n0,
          K,
          accumulate ? 1 : 0,
          false,
          false,
        );
      }
      if (!outInPlace) copyRows(out, N, outView, N8, M);
      return;
    }
    for (let k0 = 0; k0 < K; k0 += slab) {
      const k1 = Math.min(K, k0 + slab);
      if (own && layout === "b") this.weightToB(panels!, own, k0, k1);
      this.gemmJobs(
        outOffset,
        ldo,
        aOffset + k0 * 4,
        lda,
        panels!,
        M,
        N,
        k1 - k0,
        accumulate || k0 > 0 ? 1 : 0,
        transposedA,
        bf16,
      );
    }
    if (!outInPlace) copyRows(out, N, outView, N8, M);
  }

  /**
   * outs[i][M,Ns[i]] (+)= A·Wᵢᵀ on q8 weights: A's rows quantized once per block of 32 into
   * scratch (`quantize_q8`), then `gemm_q8` for each weight, rows (or, for a few rows, quads of
   * columns) shared among threads, all the weights' tasks in one hand-off; every element's sum
   * is the same whichever thread computes it.
   */
  private gemmsQ8(
    outs: readonly Float32Array[],
    a: Float32Array,
    weights: readonly ArenaWeight[],
    M: number,
    Ns: readonly number[],
    K: number,
    accumulate: boolean,
  ): void {
    let top = this.heap.top;
    let aOffset = this.offsetOf(a);
    if (aOffset < 0) {
      aOffset = top;
      top += align(M * K * 4);
    }
    // Each output in place when it is in the arena and its rows are whole quads, else scratch.
    const outOffsets = outs.map((out, i) => {
      const N = Ns[i]!;
      const at = N % 4 === 0 ? this.offsetOf(out) : -1;
      if (at >= 0) return at;
      const o = top;
      top += align(M * Math.ceil(N / 4) * 16);
      return o;
    });
    const xq = top;
    top += align(M * K);
    const sa = top;
    top += align((M * K) / 8);
    this.ensure(top);
    const buffer = this.memory.buffer;
    if (aOffset !== this.offsetOf(a))
      new Float32Array(buffer, aOffset, M * K).set(a.subarray(0, M * K));
    const scratchOut = (i: number) => outOffsets[i] !== this.offsetOf(outs[i]!);
    outs.forEach((out, i) => {
      if (accumulate && scratchOut(i)) {
        const N4 = Math.ceil(Ns[i]! / 4) * 4;
        copyRows(new Float32Array(buffer, outOffsets[i]!, M * N4), N4, out, Ns[i]!, M);
      }
    });
    const nb = K / 32;
    this.byRows("quantize_q8", M, M * K * 8, (r0, r1) => ({
      dst: xq + r0 * K,
      sa: sa + r0 * nb * 4,
      src: aOffset + r0 * K * 4,
      lda: K * 4,
      rows: r1 - r0,
      K,
    }));
    const totalN = Ns.reduce((n, N) => n + N, 0);
    const parts = this.parts(2 * M * totalN * K);
    const stride = q8QuadStride(K);
    if (parts === 1) {
      // A small call stays on this thread, whatever the number of weights (no jobs made).
      const gemm = this.exports.gemm_q8;
      weights.forEach((weight, i) => {
        gemm(
          outOffsets[i]!,
          Math.ceil(Ns[i]! / 4) * 16,
          xq,
          sa,
          weight.offset,
          M,
          Ns[i]!,
          K,
          accumulate ? 1 : 0,
        );
      });
    } else {
      const jobs: Job[] = [];
      weights.forEach((weight, i) => {
        const quads = Math.ceil(Ns[i]! / 4);
        const ldo = quads * 16;
        const outOffset = outOffsets[i]!;
        const task = (m0: number, m1: number, q0: number, q1: number): Job =>
          call("gemm_q8", {
            out: outOffset + m0 * ldo + q0 * 16,
            ldo,
            a: xq + m0 * K,
            sa: sa + m0 * nb * 4,
            p: weight.offset + q0 * stride,
            M: m1 - m0,
            N: (q1 - q0) * 4,
            K,
            acc: accumulate ? 1 : 0,
          });
        // This weight's share of the call's tasks.
        const share = Math.max(1, Math.round((parts * Ns[i]!) / totalN));
        if (share > 1 && Math.ceil(M / 4) < share && quads >= share) {
          for (const [q0, q1] of splitEven(quads, share))
            if (q1 > q0) jobs.push(task(0, M, q0, q1));
        } else {
          for (let p = 0; p < share; p++) {
            const m0 = Math.min(M, Math.round((M * p) / share / 4) * 4);
            const m1 = p === share - 1 ? M : Math.min(M, Math.round((M * (p + 1)) / share / 4) * 4);
            if (m1 > m0) jobs.push(task(m0, m1, 0, quads));
          }
        }
      });
      this.runJobs(jobs);
    }
    outs.forEach((out, i) => {
      if (!scratchOut(i)) return;
      const N = Ns[i]!;
      const N4 = Math.ceil(N / 4) * 4;
      copyRows(out, N, new Float32Array(buffer, outOffsets[i]!, M * N4), N4, M);
    });
  }

  /** One GEMM over packed panels, its rows (or, for a few rows, its columns) shared among threads. */
  private gemmJobs(
    outOffset: number,
    ldo: number,
    aOffset: number,
    lda: number,
    panels: number,
    M: number,
    N: number,
    K: number,
    acc: number,
    transposedA: boolean,
    bf16: boolean,
  ): void {
    const parts = this.parts(2 * M * N * K);
    const jobs: Job[] = [];
    const ps = bf16 ? K * 16 : K * 32;
    /** Rows [m0, m1) against the panels of columns [n0, n1). */
    const task = (m0: number, m1: number, n0: number, n1: number): Job =>
      call(bf16 ? "gemm_bf16" : "gemm", {
        out: outOffset + m0 * ldo + n0 * 4,
        ldo,
        a: aOffset + m0 * lda,
        lda,
        p: panels + (n0 / 8) * ps,
        ps,
        M: m1 - m0,
        N: n1 - n0,
        K,
        acc,
      });
    const panels8 = Math.ceil(N / 8);
    if (!transposedA && parts > 1 && Math.ceil(M / 6) < parts && panels8 >= parts) {
      // Fewer 6-row tiles than tasks (decoding a few sequences): the columns are split instead,
      // in whole panels, every task computing all the rows; each element's sum is the same.
      for (const [p0, p1] of splitEven(panels8, parts))
        if (p1 > p0) jobs.push(task(0, M, p0 * 8, Math.min(N, p1 * 8)));
      this.runJobs(jobs);
      return;
    }
    for (let i = 0; i < parts; i++) {
      // Rows split in whole 6-row tiles; every element's sum is the same whichever thread runs it.
      const m0 = Math.min(M, Math.round((M * i) / parts / 6) * 6);
      const m1 = i === parts - 1 ? M : Math.min(M, Math.round((M * (i + 1)) / parts / 6) * 6);
      if (m1 <= m0) continue;
      const o = outOffset + m0 * ldo;
      jobs.push(
        transposedA
          ? gemmAtJob(
              {
                out: o,
                ldo,
                a: aOffset + m0 * 4,
                lda,
                p: panels,
                ps: K * 32,
                M: m1 - m0,
                N,
                K,
                acc,
              },
              this.tnChunk,
            )
          : task(m0, m1, 0, N),
      );
    }
    this.runJobs(jobs);
  }

  matmulNT(
    out: Float32Array,
    a: Float32Array,
    b: Float32Array | WeightSource,
    M: number,
    N: number,
    K: number,
    accumulate = false,
    bVersion?: number,
  ): void {
    this.gemm(out, a, b, "w", M, N, K, accumulate, bVersion, false);
  }

  matmulNTShared(
    outs: readonly Float32Array[],
    a: Float32Array,
    bs: readonly (Float32Array | WeightSource)[],
    M: number,
    Ns: readonly number[],
    K: number,
    bVersion?: number,
  ): void {
    const own = bs.map((b) => (b instanceof ArenaWeight && b.kernels === this ? b : null));
    if (own.every((w) => w?.dtype === "q8")) {
      for (const w of own) w!.live();
      this.gemmsQ8(outs, a, own as ArenaWeight[], M, Ns, K, false);
      return;
    }
    for (let i = 0; i < bs.length; i++)
      this.gemm(outs[i]!, a, bs[i]!, "w", M, Ns[i]!, K, false, bVersion, false);
  }

  matmulNN(
    out: Float32Array,
    a: Float32Array,
    b: Float32Array | WeightSource,
    M: number,
    N: number,
    K: number,
    accumulate = false,
    bVersion?: number,
  ): void {
    this.gemm(out, a, b, "b", M, N, K, accumulate, bVersion, false);
  }

  matmulTN(
    out: Float32Array,
    a: Float32Array,
    b: Float32Array,
    M: number,
    N: number,
    K: number,
    accumulate = false,
  ): void {
    this.gemm(out, a, b, "b", M, N, K, accumulate, undefined, true);
  }

  /**
   * Offsets of operands: arrays already in the arena are used in place; other arrays are
   * copied into consecutive scratch slots above the heap, and numbers reserve that many floats.
   */
  private stage(arrays: (Float32Array | number)[]): number[] {
    let top = this.heap.top;
    const offsets: number[] = [];
    for (const a of arrays) {
      const inArena = typeof a === "number" ? -1 : this.offsetOf(a);
      offsets.push(inArena >= 0 ? inArena : top);
      if (inArena < 0) top += align((typeof a === "number" ? a : a.length) * 4 + 16);
    }
    this.ensure(top);
    const buffer = this.memory.buffer;
    arrays.forEach((a, i) => {
      if (typeof a !== "number" && this.offsetOf(a) < 0)
        new Float32Array(buffer, offsets[i]!, a.length).set(a);
    });
    return offsets;
  }

  /**
   * Runs a row-wise kernel over `rows` rows, split among threads when the call is large:
   * `args(r0, r1)` gives the kernel's arguments for rows [r0, r1).
   */
  private byRows<K extends KernelName>(
    kernel: K,
    rows: number,
    work: number,
    args: (r0: number, r1: number) => KernelArgs<K>,
  ): void {
    const parts = Math.min(rows, this.parts(work));
    if (parts <= 1) {
      invoke(this.exports, kernel, args(0, rows));
      return;
    }
    this.runJobs(splitEven(rows, parts).map(([r0, r1]) => call(kernel, args(r0, r1))));
  }

  rmsNorm(
    out: Float32Array,
    x: Float32Array,
    weight: Float32Array,
    rows: number,
    D: number,
    eps: number,
    inv?: Float32Array,
  ): void {
    if (D % 4 !== 0) {
      jsKernels.rmsNorm(out, x, weight, rows, D, eps, inv);
      return;
    }
    const [xo, wo, oo, io] = this.stage([
      x.subarray(0, rows * D),
      weight,
      this.output(out, rows * D),
      inv ? this.output(inv, rows) : rows,
    ]) as [number, number, number, number];
    const b = D * 4;
    this.byRows("rms_norm", rows, rows * D * 8, (r0, r1) => ({
      out: oo + r0 * b,
      inv: io + r0 * 4,
      x: xo + r0 * b,
      w: wo,
      rows: r1 - r0,
      D,
      eps,
    }));
    this.copyOut(out, oo, rows * D);
    if (inv) this.copyOut(inv, io, rows);
  }

  rmsNormBackward(
    dx: Float32Array,
    dw: Float32Array,
    dy: Float32Array,
    x: Float32Array,
    inv: Float32Array,
    w: Float32Array,
    rows: number,
    D: number,
  ): void {
    if (D % 4 !== 0) {
      jsKernels.rmsNormBackward(dx, dw, dy, x, inv, w, rows, D);
      return;
    }
    const [dxo, dwo, dyo, xo, io, wo] = this.stage([
      this.output(dx, rows * D),
      dw,
      dy.subarray(0, rows * D),
      x.subarray(0, rows * D),
      inv.subarray(0, rows),
      w,
    ]) as [number, number, number, number, number, number];
    const b = D * 4;
    // The weight gradient sums over rows: one thread, rows in order; first, in case dx is dy.
    invoke(this.exports, "rms_norm_dw", { dw: dwo, dy: dyo, x: xo, inv: io, rows, D });
    this.byRows("rms_norm_backward", rows, rows * D * 8, (r0, r1) => ({
      dx: dxo + r0 * b,
      dy: dyo + r0 * b,
      x: xo + r0 * b,
      inv: io + r0 * 4,
      w: wo,
      rows: r1 - r0,
      D,
    }));
    this.copyOut(dx, dxo, rows * D);
    this.copyOut(dw, dwo, D);
  }

  swiglu(out: Float32Array, gate: Float32Array, up: Float32Array, n: number): void {
    if (n % 4 !== 0) {
      jsKernels.swiglu(out, gate, up, n);
      return;
    }
    const [go, uo, oo] = this.stage([
      gate.subarray(0, n),
      up.subarray(0, n),
      this.output(out, n),
    ]) as [number, number, number];
    // Split in runs of 4 floats (one vector).
    this.byRows("swiglu", n / 4, n * 16, (r0, r1) => ({
      out: oo + r0 * 16,
      gate: go + r0 * 16,
      up: uo + r0 * 16,
      n: (r1 - r0) * 4,
    }));
    this.copyOut(out, oo, n);
  }

  attention(
    out: Float32Array,
    q: Float32Array,
    keys: Float32Array,
    values: Float32Array,
    n: number,
    start: number,
    H: number,
    KV: number,
    hd: number,
    sequences = 1,
  ): void {
    if (hd % 4 !== 0) {
      jsKernels.attention(out, q, keys, values, n, start, H, KV, hd, sequences);
      return;
    }
    const scale = 1 / Math.sqrt(hd);
    const qn = sequences * n * H * hd;
    const qb = H * hd * 4;
    if (sequences > 1) {
      const kvn = sequences * n * KV * hd;
      const parts = Math.min(sequences, this.parts(sequences * n * n * H * hd * 2));
      const [qo, ko, vo, oo, ...scores] = this.stage([
        q.subarray(0, qn),
        keys.subarray(0, kvn),
        values.subarray(0, kvn),
        this.output(out, qn),
        ...Array<number>(parts).fill(n + 4),
      ]) as number[] as [number, number, number, number, ...number[]];
      this.runJobs(
        splitEven(sequences, parts).map(([s0, s1], i) =>
          attentionStackedJob(
            {
              out: oo + s0 * n * qb,
              q: qo + s0 * n * qb,
              k: ko + s0 * n * KV * hd * 4,
              v: vo + s0 * n * KV * hd * 4,
              n,
              H,
              KV,
              hd,
              scale,
              scores: scores[i]!,
            },
            s1 - s0,
          ),
        ),
      );
      this.copyOut(out, oo, qn);
      return;
    }
    const span = (start + n) * KV * hd;
    // Decoding against a KV cache: keep an arena mirror of it and copy only the new rows. A call
    // from position 0 (re)fills the cache: whatever the mirror held is stale from then on.
    if (start === 0) {
      for (const array of [keys, values]) {
        const entry = this.mirrors.get(array);
        if (entry) entry.synced = 0;
      }
    }
    // A cache kept in the arena (`array`) is read where it is.
    const cached = (a: Float32Array) => {
      const at = this.offsetOf(a);
      return at >= 0 ? at : this.mirror(a, start * KV * hd, span);
    };
    const ko = start > 0 ? cached(keys) : -1;
    const vo = start > 0 ? cached(values) : -1;
    const parts = this.parts(n * (start + n) * H * hd * 2);
    const staged = this.stage([
      q.subarray(0, qn),
      this.output(out, qn),
      ...(start > 0 ? [] : [keys.subarray(0, span), values.subarray(0, span)]),
      ...Array<number>(parts).fill(start + n + 4),
    ]);
    const [qo, oo] = staged as [number, number];
    const [kOff, vOff] = start > 0 ? [ko, vo] : [staged[2]!, staged[3]!];
    const scores = staged.slice(start > 0 ? 2 : 4);
    // Row t costs start + t + 1: split the rows so that each thread gets an equal share.
    const bounds = splitCausal(n, start, parts);
    this.runJobs(
      bounds
        .filter(([t0, t1]) => t1 > t0)
        .map(([t0, t1], i) =>
          call("attention", {
            out: oo + t0 * qb,
            q: qo + t0 * qb,
            k: kOff,
            v: vOff,
            n: t1 - t0,
            start: start + t0,
            H,
            KV,
            hd,
            scale,
            scores: scores[i]!,
          }),
        ),
    );
    this.copyOut(out, oo, qn);
  }

  attentionBackward(
    dq: Float32Array,
    dk: Float32Array,
    dv: Float32Array,
    q: Float32Array,
    keys: Float32Array,
    values: Float32Array,
    dOut: Float32Array,
    n: number,
    H: number,
    KV: number,
    hd: number,
    sequences = 1,
  ): void {
    if (hd % 4 !== 0) {
      jsKernels.attentionBackward(dq, dk, dv, q, keys, values, dOut, n, H, KV, hd, sequences);
      return;
    }
    const qn = sequences * n * H * hd;
    const kvn = sequences * n * KV * hd;
    // Sequences are independent, so they are shared out whole: dk and dv never race.
    const parts = Math.min(sequences, this.parts(sequences * n * n * H * hd * 4));
    const [dqo, dko, dvo, qo, ko, vo, doo, ...scratch] = this.stage([
      dq.subarray(0, qn),
      dk.subarray(0, kvn),
      dv.subarray(0, kvn),
      q.subarray(0, qn),
      keys.subarray(0, kvn),
      values.subarray(0, kvn),
      dOut.subarray(0, qn),
      ...Array<number>(2 * parts).fill(n + 4),
    ]) as number[] as [number, number, number, number, number, number, number, ...number[]];
    const qb = n * H * hd * 4;
    const kb = n * KV * hd * 4;
    const jobs = splitEven(sequences, parts).map(([s0, s1], i) =>
      attentionBackwardJob(
        {
          dq: dqo + s0 * qb,
          dk: dko + s0 * kb,
          dv: dvo + s0 * kb,
          q: qo + s0 * qb,
          k: ko + s0 * kb,
          v: vo + s0 * kb,
          dout: doo + s0 * qb,
          n,
          H,
          KV,
          hd,
          scale: 1 / Math.sqrt(hd),
          scores: scratch[2 * i]!,
          dps: scratch[2 * i + 1]!,
        },
        s1 - s0,
      ),
    );
    this.runJobs(jobs);
    this.copyOut(dq, dqo, qn);
    this.copyOut(dk, dko, kvn);
    this.copyOut(dv, dvo, kvn);
  }

  swigluBackward(
    dGate: Float32Array,
    dUp: Float32Array,
    dOut: Float32Array,
    gate: Float32Array,
    up: Float32Array,
    n: number,
  ): void {
    if (n % 4 !== 0) {
      jsKernels.swigluBackward(dGate, dUp, dOut, gate, up, n);
      return;
    }
    const [go, uo, dOutO, dgo, duo] = this.stage([
      gate.subarray(0, n),
      up.subarray(0, n),
      dOut.subarray(0, n),
      this.output(dGate, n),
      this.output(dUp, n),
    ]) as [number, number, number, number, number];
    this.byRows("swiglu_backward", n / 4, n * 24, (r0, r1) => {
      const o = r0 * 16;
      return {
        dgate: dgo + o,
        dup: duo + o,
        dout: dOutO + o,
        gate: go + o,
        up: uo + o,
        n: (r1 - r0) * 4,
      };
    });
    this.copyOut(dGate, dgo, n);
    this.copyOut(dUp, duo, n);
  }

  softmaxRows(
    x: Float32Array,
    rows: number,
    cols: number,
    scale: Float32Array,
    rowMax: Float32Array,
    rowSum: Float32Array,
  ): void {
    if (cols % 4 !== 0) {
      jsKernels.softmaxRows(x, rows, cols, scale, rowMax, rowSum);
      return;
    }
    const [xo, so, mo, sumo] = this.stage([
      x.subarray(0, rows * cols),
      scale.subarray(0, rows),
      this.output(rowMax, rows),
      this.output(rowSum, rows),
    ]) as [number, number, number, number];
    this.byRows("softmax_rows", rows, rows * cols * 16, (r0, r1) => ({
      x: xo + r0 * cols * 4,
      rows: r1 - r0,
      cols,
      scale: so + r0 * 4,
      rmax: mo + r0 * 4,
      rsum: sumo + r0 * 4,
    }));
    this.copyOut(x, xo, rows * cols);
    this.copyOut(rowMax, mo, rows);
    this.copyOut(rowSum, sumo, rows);
  }
}

/** Where column c of a BF16 panel row is stored (the order 0 4 1 5 2 6 3 7, see `narrowBf16`). */
const BF16_LANE = [0, 2, 4, 6, 1, 3, 5, 7];

/** A weight packed in a `WasmKernels` arena (see `packWeight`). */
class ArenaWeight implements PackedWeight {
  readonly kernels: WasmKernels;
  /** Byte offset of its panels in the arena. */
  offset: number;
  readonly rows: number;
  readonly cols: number;
  readonly dtype: WeightDtype;
  readonly bytes: number;

  constructor(
    kernels: WasmKernels,
    offset: number,
    rows: number,
    cols: number,
    dtype: WeightDtype,
    bytes: number,
  ) {
    this.kernels = kernels;
    this.offset = offset;
    this.rows = rows;
    this.cols = cols;
    this.dtype = dtype;
    this.bytes = bytes;
  }

  get length(): number {
    return this.rows * this.cols;
  }

  writeRows(r0: number, data: Float32Array): void {
    this.live();
    this.kernels.writePacked(this, r0, data);
  }

  release(): void {
    if (this.offset < 0) return;
    this.kernels.releasePacked(this);
    this.offset = -1;
  }

  /** Throws when the weight was released (its arena block may hold something else now). */
  live(): void {
    if (this.offset < 0) throw new Error("kernels: a released weight was used");
  }

  readRows(r0: number, r1: number, out?: Float32Array): Float32Array {
    this.live();
    return this.kernels.readPacked(this, r0, r1, out);
  }
}

/** A split call gets one task per thread per this many FLOPs, up to MAX_TASKS_PER_THREAD. */
const FLOPS_PER_TASK = 32 << 20;
const MAX_TASKS_PER_THREAD = 4;

/** Kernel calls below this many FLOPs stay on the calling thread (a hand-off costs ~5–50 µs). */
const PARALLEL_FLOPS = 1 << 22;

/** [from, to) ranges splitting `count` items into `parts` nearly equal runs. */
function splitEven(count: number, parts: number): [number, number][] {
  return Array.from({ length: parts }, (_, i) => [
    Math.round((count * i) / parts),
    Math.round((count * (i + 1)) / parts),
  ]);
}

/** [from, to) rows of a causal attention, row t costing start + t + 1, in equal-cost parts. */
function splitCausal(n: number, start: number, parts: number): [number, number][] {
  const total = n * start + (n * (n + 1)) / 2;
  const bounds: [number, number][] = [];
  let t = 0;
  let cost = 0;
  for (let i = 0; i < parts; i++) {
    const from = t;
    const target = (total * (i + 1)) / parts;
    while (t < n && (i === parts - 1 || cost + start + t + 1 <= target)) {
      cost += start + t + 1;
      t++;
    }
    bounds.push([from, t]);
  }
  return bounds;
}

/** Bytes of B[K,N] in 8-column panels. */
/** Bytes of W[N,K] (or B[K,N]) packed into panels of 8 columns, N padded to a whole panel. */
export function panelBytes(N: number, K: number): number {
  return Math.ceil(N / 8) * K * 32;
}

/** Copies M rows of `cols` floats between arrays whose rows are `ldDst` and `ldSrc` apart. */
function copyRows(
  dst: Float32Array,
  ldDst: number,
  src: Float32Array,
  ldSrc: number,
  M: number,
): void {
  if (ldDst === ldSrc) {
    dst.set(src.subarray(0, M * ldSrc));
    return;
  }
  const cols = Math.min(ldDst, ldSrc);
  for (let m = 0; m < M; m++) dst.set(src.subarray(m * ldSrc, m * ldSrc + cols), m * ldDst);
}

const relaxedBytes = readFileSync(new URL("./wasm/kernels-relaxed.wasm", import.meta.url));
const simdBytes = readFileSync(new URL("./wasm/kernels-simd.wasm", import.meta.url));
const relaxed64Bytes = readFileSync(new URL("./wasm/kernels-relaxed-64.wasm", import.meta.url));
const simd64Bytes = readFileSync(new URL("./wasm/kernels-simd-64.wasm", import.meta.url));

/** Whether this runtime accepts relaxed-SIMD (decided once, by WebAssembly.validate). */
export const relaxedSimdSupported = WebAssembly.validate(relaxedBytes);

/** The most threads one kernel set uses (the calling thread and its helpers). */
export const MAX_THREADS = 64;

export interface WasmKernelOptions {
  /** Threads sharing each large kernel call, this one included (default 1). */
  threads?: number;
  /**
   * Bytes the arena may grow to: at least 16 MiB; by default and at most 4 GiB (wasm32), or
   * with `memory64` at most 16 GiB and by default `memory64Limit()`.
   */
  memoryLimit?: number;
  /**
   * A Memory64 arena, for models that do not fit in 4 GiB. Every address is then 64-bit, which
   * V8 checks on each access (`bench/engine-families.ts --arena` measures the cost); default
   * false. Integer arguments reach the kernels as f64 (a missing one traps, not 0).
   */
  memory64?: boolean;
}

export function createWasmKernels(
  variant: "auto" | "relaxed" | "simd" = "auto",
  options: WasmKernelOptions = {},
): WasmKernels {
  const useRelaxed = variant === "relaxed" || (variant === "auto" && relaxedSimdSupported);
  const wide = options.memory64 ?? false;
  const bytes = useRelaxed
    ? wide
      ? relaxed64Bytes
      : relaxedBytes
    : wide
      ? simd64Bytes
      : simdBytes;
  const name = `${useRelaxed ? "wasm-relaxed-simd" : "wasm-simd"}${wide ? "-memory64" : ""}`;
  return new WasmKernels(bytes, name, options);
}

let shared: WasmKernels | null = null;

/** The kernels an engine or trainer uses when none are given: WASM SIMD (relaxed if supported)
 * on this thread alone. Pass kernels from `createWasmKernels(…, { threads })` to use more. */
export function defaultKernels(): Kernels {
  shared ??= createWasmKernels("auto", { threads: 1 });
  return shared;
}
