/**
 * Kernel jobs as plain numbers, so a worker thread and the calling thread run the same code
 * on one shared arena. A job is an opcode and up to 16 arguments (offsets, sizes, scalars).
 */

type Fn = (...args: number[]) => void;

/** Kernels a job calls by index with their own arguments (`Op.call`). */
export const CALLS = [
  "gemm",
  "gemm_bf16",
  "attention",
  "rms_norm",
  "rms_norm_backward",
  "swiglu",
  "swiglu_backward",
  "softmax_rows",
] as const;

export type JobExports = Record<"gemm_at" | "attention_backward" | (typeof CALLS)[number], Fn>;

export const Op = {
  /** CALLS[args[0]](...args[1..]) with as many arguments as the export takes. */
  call: 0,
  /** gemm_at over K in chunks of `chunk` rows: (out, ldo, a, lda, p, ps, M, N, K, acc, chunk) */
  gemmAt: 1,
  /** attention over `count` stacked sequences from position 0: (out, q, k, v, n, H, KV, hd, scale, scores, count) */
  attentionStacked: 2,
  /**
   * attention_backward for `count` sequences of n rows stacked one after another:
   * (dq, dk, dv, q, k, v, dout, n, H, KV, hd, scale, scores, dps, count)
   */
  attentionBackward: 3,
} as const;

export const MAX_ARGS = 16;

/** A job calling `CALLS` export `name` with `args`. */
export function call(name: (typeof CALLS)[number], args: number[]): { op: number; args: number[] } {
  return { op: Op.call, args: [CALLS.indexOf(name), ...args] };
}

/** Calls `f` with the byte offsets of each of `count` stacked sequences in q-like and kv-like operands. */
function perSequence(
  count: number,
  n: number,
  H: number,
  KV: number,
  hd: number,
  f: (qOffset: number, kvOffset: number) => void,
): void {
  for (let s = 0; s < count; s++) f(s * n * H * hd * 4, s * n * KV * hd * 4);
}

export function runJob(ex: JobExports, op: number, a: Float64Array | number[]): void {
  switch (op) {
    case Op.call: {
      const fn = ex[CALLS[a[0]!]!];
      fn(...Array.prototype.slice.call(a, 1, 1 + fn.length));
      return;
    }
    case Op.gemmAt: {
      const [out, ldo, aOff, lda, p, ps, M, N, K, acc, chunk] = a as number[];
      for (let k0 = 0; k0 < K!; k0 += chunk!) {
        const kc = Math.min(chunk!, K! - k0);
        const accumulate = acc || k0 > 0 ? 1 : 0;
        ex.gemm_at(out!, ldo!, aOff! + k0 * lda!, lda!, p! + k0 * 32, ps!, M!, N!, kc, accumulate);
      }
      return;
    }
    case Op.attentionStacked: {
      const [out, q, k, v, n, H, KV, hd, scale, scores, count] = a as number[];
      perSequence(count!, n!, H!, KV!, hd!, (qo, ko) =>
        ex.attention(out! + qo, q! + qo, k! + ko, v! + ko, n!, 0, H!, KV!, hd!, scale!, scores!),
      );
      return;
    }
    case Op.attentionBackward: {
      const [dq, dk, dv, q, k, v, dout, n, H, KV, hd, scale, scores, dps, count] = a as number[];
      perSequence(count!, n!, H!, KV!, hd!, (qo, ko) =>
        ex.attention_backward(
          dq! + qo,
          dk! + ko,
          dv! + ko,
          q! + qo,
          k! + ko,
          v! + ko,
          dout! + qo,
          n!,
          H!,
          KV!,
          hd!,
          scale!,
          scores!,
          dps!,
        ),
      );
      return;
    }
    default:
      throw new Error(`kernel job: unknown op ${op}`);
  }
}
