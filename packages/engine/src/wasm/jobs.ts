/**
 * Kernel jobs as plain numbers, so a worker thread and the calling thread run the same code
 * on one shared arena. A job is an opcode and up to 14 arguments (offsets, sizes, scalars).
 */

type Fn = (...args: number[]) => void;

/** Row-wise kernels a job can call by index with their own arguments (`Op.call`). */
export const CALLS = [
  "rms_norm",
  "rms_norm_backward",
  "swiglu",
  "swiglu_backward",
  "softmax_rows",
] as const;

export type JobExports = Record<
  "gemm" | "gemm_at" | "attention" | "attention_backward" | (typeof CALLS)[number],
  Fn
>;

export const Op = {
  /** gemm(out, ldo, a, lda, p, ps, M, N, K, acc) */
  gemm: 0,
  /** gemm_at over K in chunks of `chunk` rows: (out, ldo, a, lda, p, ps, M, N, K, acc, chunk) */
  gemmAt: 1,
  /** attention(out, q, k, v, n, start, H, KV, hd, scale, scores) */
  attention: 2,
  /**
   * attention_backward for `count` sequences of n rows stacked one after another:
   * (dq, dk, dv, q, k, v, dout, n, H, KV, hd, scale, scores, dps, count)
   */
  attentionBackward: 3,
  /** attention over `count` stacked sequences from position 0: (out, q, k, v, n, H, KV, hd, scale, scores, count) */
  attentionStacked: 4,
  /** CALLS[args[0]](...args[1..]) with as many arguments as the export takes. */
  call: 6,
} as const;

export const MAX_ARGS = 16;

export function runJob(ex: JobExports, op: number, a: Float64Array | number[]): void {
  switch (op) {
    case Op.gemm:
      ex.gemm(a[0]!, a[1]!, a[2]!, a[3]!, a[4]!, a[5]!, a[6]!, a[7]!, a[8]!, a[9]!);
      return;
    case Op.gemmAt: {
      const [out, ldo, aOff, lda, p, ps, M, N, K, acc, chunk] = a as number[];
      for (let k0 = 0; k0 < K!; k0 += chunk!) {
        const kc = Math.min(chunk!, K! - k0);
        const accumulate = acc || k0 > 0 ? 1 : 0;
        ex.gemm_at(out!, ldo!, aOff! + k0 * lda!, lda!, p! + k0 * 32, ps!, M!, N!, kc, accumulate);
      }
      return;
    }
    case Op.attention:
      ex.attention(a[0]!, a[1]!, a[2]!, a[3]!, a[4]!, a[5]!, a[6]!, a[7]!, a[8]!, a[9]!, a[10]!);
      return;
    case Op.attentionBackward: {
      const [dq, dk, dv, q, k, v, dout, n, H, KV, hd, scale, scores, dps, count] = a as number[];
      const qb = n! * H! * hd! * 4;
      const kb = n! * KV! * hd! * 4;
      for (let s = 0; s < count!; s++) {
        ex.attention_backward(
          dq! + s * qb,
          dk! + s * kb,
          dv! + s * kb,
          q! + s * qb,
          k! + s * kb,
          v! + s * kb,
          dout! + s * qb,
          n!,
          H!,
          KV!,
          hd!,
          scale!,
          scores!,
          dps!,
        );
      }
      return;
    }
    case Op.attentionStacked: {
      const [out, q, k, v, n, H, KV, hd, scale, scores, count] = a as number[];
      const qb = n! * H! * hd! * 4;
      const kb = n! * KV! * hd! * 4;
      for (let s = 0; s < count!; s++) {
        ex.attention(
          out! + s * qb,
          q! + s * qb,
          k! + s * kb,
          v! + s * kb,
          n!,
          0,
          H!,
          KV!,
          hd!,
          scale!,
          scores!,
        );
      }
      return;
    }
    case Op.call: {
      const fn = ex[CALLS[a[0]!]!];
      fn(...Array.prototype.slice.call(a, 1, 1 + fn.length));
      return;
    }
    default:
      throw new Error(`kernel job: unknown op ${op}`);
  }
}
