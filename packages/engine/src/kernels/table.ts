/**
 * The kernel table: every WebAssembly kernel, declared once with its named, typed parameters
 * and its body. From it come the kernels' text in all four builds (`scripts/build-wasm.ts`:
 * relaxed or plain SIMD, on a wasm32 or a Memory64 arena), the typed exports
 * (`KernelExports`), the thread pool's jobs (`wasm/jobs.ts`: arguments by name, laid out in the
 * table's order) and the signatures of the `Kernels` methods that take a kernel's arguments
 * (`KernelArrays`), which the WASM kernels and the JS reference both implement.
 */
import * as body from "./wasm/bodies.ts";
import * as q8 from "./wasm/q8-bodies.ts";
import type { Body, Param, Wat } from "./wasm/wat.ts";

/** A byte offset in the kernels' arena. */
const ptr = <const N extends string>(name: N) => ({ name, type: "ptr" }) as const;
/** A count, size or flag. */
const int = <const N extends string>(name: N) => ({ name, type: "int" }) as const;
const f32 = <const N extends string>(name: N) => ({ name, type: "f32" }) as const;
/** A parameter the `WasmKernels` method supplies itself: not among its caller's arguments. */
const internal = <const P extends Param>(param: P) => ({ ...param, internal: true }) as const;

interface Kernel<P extends readonly Param[]> {
  readonly params: P;
  /** Its locals and instructions in one build; the table's parameters are declared for it. */
  readonly body: (w: Wat) => Body;
}

const kernel = <const P extends readonly Param[]>(k: Kernel<P>): Kernel<P> => k;

/** A GEMM's operands: `p` its B panels, `ps` bytes apart; `acc` adds onto `out` (see `gemm`). */
const GEMM = [
  ptr("out"),
  int("ldo"),
  ptr("a"),
  int("lda"),
  ptr("p"),
  int("ps"),
  int("M"),
  int("N"),
  int("K"),
  int("acc"),
] as const;
const WEIGHT_TO_B = [
  ptr("dst"),
  ptr("src"),
  int("panels"),
  int("blocks"),
  int("K"),
  int("N"),
] as const;
const PACK = [ptr("dst"), ptr("src"), int("N"), int("K"), int("ps")] as const;

/** The kernels in the order of the module's functions (and of its exports). */
export const KERNELS = {
  /** out[M,N] (+)= A·B on packed B panels (`ldo`, `lda`: row strides in bytes). */
  gemm: kernel({ params: GEMM, body: (w) => body.gemm(w, false) }),
  /** `gemm` with A read transposed: A(m,k) at a + k·lda + 4m (weight gradients). */
  gemm_at: kernel({ params: GEMM, body: (w) => body.gemm(w, true) }),
  /** `gemm` on panels of BF16 numbers, widened as they are loaded (`ps` = K·16). */
  gemm_bf16: kernel({ params: GEMM, body: (w) => body.gemm(w, false, true) }),
  /** n F32 values (whole panel rows) narrowed to BF16 panel rows. */
  narrow_bf16: kernel({ params: [ptr("dst"), ptr("src"), int("n")], body: body.narrowBf16 }),
  /** n BF16 values (whole panel rows) widened to F32 panel rows. */
  widen_bf16: kernel({ params: [ptr("dst"), ptr("src"), int("n")], body: body.widenBf16 }),
  /** B-panels of the whole 8×8 blocks of W-panels (see `weightToB`). */
  weight_to_b: kernel({ params: WEIGHT_TO_B, body: (w) => body.weightToB(w, false) }),
  weight_to_b_bf16: kernel({ params: WEIGHT_TO_B, body: (w) => body.weightToB(w, true) }),
  /** B[K,N] packed into GEMM panels. */
  pack_b: kernel({ params: PACK, body: (w) => body.pack(w, false) }),
  /** A Linear weight W[N,K] packed into GEMM panels as Wᵀ. */
  pack_w: kernel({ params: PACK, body: (w) => body.pack(w, true) }),
  rms_norm: kernel({
    params: [ptr("out"), ptr("inv"), ptr("x"), ptr("w"), int("rows"), int("D"), f32("eps")],
    body: body.rmsNorm,
  }),
  rms_norm_backward: kernel({
    params: [ptr("dx"), ptr("dy"), ptr("x"), ptr("inv"), ptr("w"), int("rows"), int("D")],
    body: body.rmsNormBackward,
  }),
  rms_norm_dw: kernel({
    params: [ptr("dw"), ptr("dy"), ptr("x"), ptr("inv"), int("rows"), int("D")],
    body: body.rmsNormDw,
  }),
  swiglu: kernel({
    params: [ptr("out"), ptr("gate"), ptr("up"), int("n")],
    body: body.swiglu,
  }),
  attention: kernel({
    params: [
      ptr("out"),
      ptr("q"),
      ptr("k"),
      ptr("v"),
      int("n"),
      int("start"),
      int("H"),
      int("KV"),
      int("hd"),
      internal(f32("scale")),
      internal(ptr("scores")),
    ],
    body: (w) => body.attentionKernels(w).forward,
  }),
  attention_backward: kernel({
    params: [
      ptr("dq"),
      ptr("dk"),
      ptr("dv"),
      ptr("q"),
      ptr("k"),
      ptr("v"),
      ptr("dout"),
      int("n"),
      int("H"),
      int("KV"),
      int("hd"),
      internal(f32("scale")),
      internal(ptr("scores")),
      internal(ptr("dps")),
    ],
    body: (w) => body.attentionKernels(w).backward,
  }),
  swiglu_backward: kernel({
    params: [ptr("dgate"), ptr("dup"), ptr("dout"), ptr("gate"), ptr("up"), int("n")],
    body: body.swigluBackward,
  }),
  softmax_rows: kernel({
    params: [ptr("x"), int("rows"), int("cols"), ptr("scale"), ptr("rmax"), ptr("rsum")],
    body: body.softmaxRows,
  }),
  /** out[M,N] (+)= A·Wᵀ on a q8 weight (`q8.ts`) and activations quantized by `quantize_q8`. */
  gemm_q8: kernel({
    params: [
      ptr("out"),
      int("ldo"),
      ptr("a"),
      ptr("sa"),
      ptr("p"),
      int("M"),
      int("N"),
      int("K"),
      int("acc"),
    ],
    body: q8.gemmQ8,
  }),
  /** Rows of F32 activations quantized per block of 32 to signed bytes, and their scales. */
  quantize_q8: kernel({
    params: [ptr("dst"), ptr("sa"), ptr("src"), int("lda"), int("rows"), int("K")],
    body: q8.quantizeQ8,
  }),
  /** F32 B-panels of quads of a q8 weight, dequantized (a backward's dX = dY·W). */
  q8_to_b: kernel({
    params: [ptr("dst"), ptr("src"), int("quads"), int("nb"), int("N")],
    body: q8.q8ToB,
  }),
};

export type KernelName = keyof typeof KERNELS;
/** The kernels' names in the table's order (a job's call index is a position here). */
export const KERNEL_NAMES = Object.keys(KERNELS) as KernelName[];

type Params<K extends KernelName> = (typeof KERNELS)[K]["params"];

type Numbers<P extends readonly Param[]> = { -readonly [I in keyof P]: number };

/** A kernel as exported: its parameters in the table's order, every one a JS number. */
type KernelFn<K extends KernelName> = (...args: Numbers<Params<K>>) => void;

/** The exports of a kernels module, typed by the table. */
export type KernelExports = { readonly [K in keyof typeof KERNELS]: KernelFn<K> };

/** A kernel's arguments by name. */
export type KernelArgs<K extends KernelName> = {
  readonly [P in Params<K>[number] as P["name"]]: number;
};

type External<P extends readonly Param[]> = P extends readonly [
  infer H extends Param,
  ...infer R extends readonly Param[],
]
  ? H extends { internal: true }
    ? External<R>
    : [H, ...External<R>]
  : [];

/**
 * The leading arguments of the `Kernels` method that runs kernel K: its parameters in order,
 * less the internal ones, pointers as the arrays they point to.
 */
export type KernelArrays<K extends KernelName> = Arrays<External<Params<K>>>;

type Arrays<P extends readonly Param[]> = {
  [I in keyof P]: P[I] extends { type: "ptr" } ? Float32Array : number;
};

/** Kernel `name`'s parameters, in order. */
export const paramsOf = (name: KernelName): readonly Param[] => KERNELS[name].params;

/** Kernel K's arguments in the order its export takes them. */
export function positional<K extends KernelName>(name: K, args: KernelArgs<K>): number[] {
  const values = args as Readonly<Record<string, number>>;
  return paramsOf(name).map((p) => values[p.name]!);
}

/** Kernel K's arguments by name, from the numbers laid out in its order (`positional`). */
export function named<K extends KernelName>(name: K, values: ArrayLike<number>): KernelArgs<K> {
  return Object.fromEntries(paramsOf(name).map((p, i) => [p.name, values[i]!])) as KernelArgs<K>;
}

/** Calls kernel `name` of `exports` with its arguments by name. */
export function invoke<K extends KernelName>(
  exports: Pick<KernelExports, K>,
  name: K,
  args: KernelArgs<K>,
): void {
  (exports[name] as (...args: number[]) => void)(...positional(name, args));
}
