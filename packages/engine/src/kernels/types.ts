import type { KernelArrays } from "./table.ts";
import type { WeightSource } from "./weight.ts";

/**
 * How a packed weight's numbers are held: F32, BF16 (widened to F32 inside the kernels), or q8:
 * int8 in blocks of 32 with a scale each (`q8.ts`, ADR 61; a weight whose shape q8 cannot hold,
 * rows not a multiple of 4 or columns of 32, is kept in BF16).
 */
export type WeightDtype = "f32" | "bf16" | "q8";

/** A weight kept packed by the kernels as its only copy; filled a block of rows at a time. */
export interface PackedWeight extends WeightSource {
  readonly dtype: WeightDtype;
  /** Bytes it takes in the kernels' memory. */
  readonly bytes: number;
  /** Packs rows [r0, r0 + data.length / cols) (r0 a multiple of 8). */
  writeRows(r0: number, data: Float32Array): void;
  /** Frees its memory now (else when it is garbage-collected); it must not be used after. */
  release(): void;
}

/** Scratch arrays for one pass (a forward, or a training step), freed together. */
export interface Workspace {
  /** A zeroed array of n floats, valid until `release()`. */
  f32(n: number): Float32Array;
  /** Frees every array of this workspace; they must not be used afterwards. */
  release(): void;
}

/** Runs `f` with a fresh workspace of `kernels`, released afterwards whatever happens. */
export function withWorkspace<T>(kernels: Kernels, f: (ws: Workspace) => T): T {
  const ws = kernels.workspace();
  try {
    return f(ws);
  } finally {
    ws.release();
  }
}

/**
 * The compute kernels the model runs on. Every output element is summed in the same order
 * whatever the number of rows, so a sequence gives the same numbers alone or in a batch.
 * A method that runs one kernel of the table (`table.ts`) takes that kernel's arguments
 * (`KernelArrays`: in the table's order and names, arrays for its pointers, less those the
 * WASM kernels supply themselves).
 */
export interface Kernels {
  readonly name: string;
  /**
   * Bytes the kernels can hold at once: the weights they keep packed, workspaces and a call's
   * scratch (a wasm32 arena's 4 GiB, or a Memory64 arena's limit); Infinity when only the
   * machine's memory bounds them.
   */
  readonly memoryLimit: number;
  /** Whether that memory is a Memory64 arena, the largest the engine makes (else wasm32, or none). */
  readonly memory64?: boolean;
  /**
   * Arrays for activations: kernels may keep them where they compute (the WASM arena), so
   * calls on them need no copies.
   */
  workspace(): Workspace;
  /**
   * A zeroed array of n floats kept in the kernels' memory until `freeArray` (or until it is
   * garbage-collected): kernel calls read and write it in place, with no copy (a KV cache).
   * Absent when the kernels have no memory of their own (plain JS).
   */
  array?(n: number): Float32Array;
  /** Frees an `array` at once; it must not be used afterwards. */
  freeArray?(a: Float32Array): void;
  /**
   * A [rows, cols] Linear weight (or embedding table) kept packed where the kernels compute, as
   * the model's only copy of it; absent when the kernels have no memory of their own (plain JS).
   */
  packWeight?(rows: number, cols: number, dtype: WeightDtype): PackedWeight;
  /**
   * out[M,N] (+)= a[M,K] · b[N,K]ᵀ — a Linear layer with PyTorch's [out, in] weights.
   * A `bVersion` marks b as a weight that kernels may cache until the version changes.
   */
  matmulNT(
    out: Float32Array,
    a: Float32Array,
    b: Float32Array | WeightSource,
    M: number,
    N: number,
    K: number,
    accumulate?: boolean,
    bVersion?: number,
  ): void;
  /**
   * Several Linears of one input, as `matmulNT` for each (no accumulation): outs[i][M, Ns[i]] =
   * a[M,K] · bs[i]ᵀ. Kernels may share work between them (q8 weights: the input is quantized
   * once, and the GEMMs go to the threads as one call); absent, callers run them one by one.
   */
  matmulNTShared?(
    outs: readonly Float32Array[],
    a: Float32Array,
    bs: readonly (Float32Array | WeightSource)[],
    M: number,
    Ns: readonly number[],
    K: number,
    bVersion?: number,
  ): void;
  /** out[M,N] (+)= a[M,K] · b[K,N]. */
  matmulNN(
    out: Float32Array,
    a: Float32Array,
    b: Float32Array | WeightSource,
    M: number,
    N: number,
    K: number,
    accumulate?: boolean,
    bVersion?: number,
  ): void;
  /** out[M,N] (+)= a[K,M]ᵀ · b[K,N] (weight gradients). */
  matmulTN(
    out: Float32Array,
    a: Float32Array,
    b: Float32Array,
    M: number,
    N: number,
    K: number,
    accumulate?: boolean,
  ): void;
  /** out[r] = x[r] / rms(x[r]) · weight, per row of length D; `inv[r]` gets 1 / rms(x[r]). */
  rmsNorm(
    out: Float32Array,
    x: Float32Array,
    weight: Float32Array,
    rows: number,
    D: number,
    eps: number,
    inv?: Float32Array,
  ): void;
  /**
   * Backward of `rmsNorm` given its saved `inv`: writes dx = d(loss)/dx and adds the weight's
   * gradient into dw.
   */
  rmsNormBackward(
    dx: Float32Array,
    dw: Float32Array,
    dy: Float32Array,
    x: Float32Array,
    inv: Float32Array,
    w: Float32Array,
    rows: number,
    D: number,
  ): void;
  /** out = silu(gate) · up, element-wise: (out, gate, up, n). */
  swiglu(...args: KernelArrays<"swiglu">): void;
  /**
   * Causal attention of n new rows at positions start… against keys k and values v
   * [≥start+n, KV·hd] (grouped-query: head h reads kv head ⌊h·KV/H⌋): (out, q, k, v, n, start,
   * H, KV, hd). q and out are [n, H·hd]. With `sequences` > 1 (start 0 only), that many
   * independent sequences of n rows are stacked in every operand.
   */
  attention(...args: [...KernelArrays<"attention">, sequences?: number]): void;
  /** dGate and dUp of out = silu(gate)·up, given dOut: (dgate, dup, dout, gate, up, n). */
  swigluBackward(...args: KernelArrays<"swiglu_backward">): void;
  /**
   * Row-wise x[r] ← softmax(x[r])·scale[r]; writes each row's max and Σexp(x − max):
   * (x, rows, cols, scale, rmax, rsum).
   */
  softmaxRows(...args: KernelArrays<"softmax_rows">): void;
  /**
   * Backward of causal self-attention over one sequence of n rows, recomputing probabilities:
   * (dq, dk, dv, q, k, v, dout, n, H, KV, hd). Adds into dq [n, H·hd], dk and dv [n, KV·hd].
   * `sequences` stacks independent sequences as in `attention`.
   */
  attentionBackward(...args: [...KernelArrays<"attention_backward">, sequences?: number]): void;
}
