/**
 * A weight matrix [rows, cols] that is not a plain array: packed in a kernel arena
 * (`PackedWeight`, where loaded models keep their weights: one copy), or computed on demand
 * (a LoRA adapter merged into its base). Read a block of rows at a time, so that export and
 * merging never unpack a whole model at once.
 */
export interface WeightSource {
  readonly rows: number;
  readonly cols: number;
  /** rows × cols. */
  readonly length: number;
  /** Rows [r0, r1) as row-major F32, into `out` when given (else a fresh array). */
  readRows(r0: number, r1: number, out?: Float32Array): Float32Array;
}

/** A Linear weight or an embedding table: a plain F32 array, or a `WeightSource`. */
export type Weight = Float32Array | WeightSource;

export function isWeightSource(w: Weight): w is WeightSource {
  return !(w instanceof Float32Array);
}

/** Rows [r0, r1) of a [rows, cols] weight (a view of a plain array; else read). */
export function weightRows(w: Weight, cols: number, r0: number, r1: number): Float32Array {
  if (!isWeightSource(w)) return w.subarray(r0 * cols, r1 * cols);
  return w.readRows(r0, r1);
}

/** Copies row `row` of a [rows, cols] weight into `out` at `at` (an embedding lookup). */
export function copyRow(w: Weight, cols: number, row: number, out: Float32Array, at: number): void {
  if (isWeightSource(w)) w.readRows(row, row + 1, out.subarray(at, at + cols));
  else out.set(w.subarray(row * cols, row * cols + cols), at);
}

/** The whole weight as one F32 array: one tensor at a time (export, tests, plain-JS kernels). */
export function weightArray(w: Weight): Float32Array {
  return isWeightSource(w) ? w.readRows(0, w.rows) : w;
}
