/**
 * Kernel jobs as plain numbers, so a worker thread and the calling thread run the same code
 * on one shared arena. A job is an opcode and up to 16 arguments (offsets, sizes, scalars),
 * made from a kernel's arguments by name and laid out in the kernel table's order.
 */
import {
  invoke,
  KERNEL_NAMES,
  type KernelArgs,
  type KernelExports,
  type KernelName,
  named,
  paramsOf,
  positional,
} from "../table.ts";

/** A job: its op and its numbers, which a task slot holds. */
export interface Job {
  op: number;
  args: number[];
}

export const Op = {
  /** KERNEL_NAMES[args[0]](...args[1..]) with as many arguments as the export takes. */
  call: 0,
  /** gemm_at over K in chunks of `chunk` rows: its arguments, then `chunk`. */
  gemmAt: 1,
  /** attention over `count` stacked sequences from position 0: its arguments, then `count`. */
  attentionStacked: 2,
  /**
   * attention_backward for `count` sequences of n rows stacked one after another: its
   * arguments, then `count`.
   */
  attentionBackward: 3,
} as const;

export const MAX_ARGS = 16;

/** A job calling kernel `name` with `args`. */
export function call<K extends KernelName>(name: K, args: KernelArgs<K>): Job {
  return { op: Op.call, args: [KERNEL_NAMES.indexOf(name), ...positional(name, args)] };
}

/** A job of `op` on kernel `name`'s arguments, then a number of the op's own (`unpack`). */
function opJob<K extends KernelName>(op: number, name: K, args: KernelArgs<K>, own: number): Job {
  return { op, args: [...positional(name, args), own] };
}

/** A job running gemm_at over K in chunks of `chunk` rows of the sum (each in L2). */
export const gemmAtJob = (args: KernelArgs<"gemm_at">, chunk: number): Job =>
  opJob(Op.gemmAt, "gemm_at", args, chunk);

/** A job running attention over `count` sequences of n rows stacked in every operand. */
export const attentionStackedJob = (
  args: Omit<KernelArgs<"attention">, "start">,
  count: number,
): Job => opJob(Op.attentionStacked, "attention", { ...args, start: 0 }, count);

/** A job running attention_backward over `count` sequences of n rows stacked in every operand. */
export const attentionBackwardJob = (args: KernelArgs<"attention_backward">, count: number): Job =>
  opJob(Op.attentionBackward, "attention_backward", args, count);

/** A kernel's arguments from a job's numbers, and the op's own number after them (`opJob`). */
function unpack<K extends KernelName>(name: K, a: ArrayLike<number>): [KernelArgs<K>, number] {
  return [named(name, a), a[paramsOf(name).length]!];
}

/**
 * Runs attention or its backward on each of `count` sequences of n rows stacked in its operands:
 * those named in `q` hold n·H·hd floats per sequence, those in `kv` n·KV·hd.
 */
function stacked<K extends "attention" | "attention_backward">(
  ex: KernelExports,
  name: K,
  a: ArrayLike<number>,
  q: readonly (keyof KernelArgs<K>)[],
  kv: readonly (keyof KernelArgs<K>)[],
): void {
  const [args, count] = unpack(name, a);
  const { n, H, KV, hd } = args as KernelArgs<"attention">;
  for (let s = 0; s < count; s++) {
    const at: Record<string, number> = { ...args };
    for (const p of q) at[p as string]! += s * n * H * hd * 4;
    for (const p of kv) at[p as string]! += s * n * KV * hd * 4;
    invoke(ex, name, at as KernelArgs<K>);
  }
}

export function runJob(ex: KernelExports, op: number, a: Float64Array | number[]): void {
  switch (op) {
    case Op.call: {
      const fn = ex[KERNEL_NAMES[a[0]!]!] as (...args: number[]) => void;
      fn(...Array.prototype.slice.call(a, 1, 1 + fn.length));
      return;
    }
    case Op.gemmAt: {
      const [g, chunk] = unpack("gemm_at", a);
      for (let k0 = 0; k0 < g.K; k0 += chunk) {
        invoke(ex, "gemm_at", {
          ...g,
          a: g.a + k0 * g.lda,
          p: g.p + k0 * 32,
          K: Math.min(chunk, g.K - k0),
          acc: g.acc || k0 > 0 ? 1 : 0,
        });
      }
      return;
    }
    case Op.attentionStacked:
      stacked(ex, "attention", a, ["out", "q"], ["k", "v"]);
      return;
    case Op.attentionBackward:
      stacked(ex, "attention_backward", a, ["dq", "q", "dout"], ["dk", "dv", "k", "v"]);
      return;
    default:
      throw new Error(`kernel job: unknown op ${op}`);
  }
}
