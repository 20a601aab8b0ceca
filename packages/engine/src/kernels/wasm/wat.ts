/**
 * WebAssembly text emitters for one build of the kernels: a memory model (wasm32, or Memory64
 * whose addresses, sizes and counters are i64) and a multiply-add (relaxed-SIMD FMA, or a
 * multiply then an add). The kernel bodies (`bodies.ts`) are written once against a `Wat`, so
 * the four builds differ only where these say.
 */

export type MemoryModel = "wasm32" | "memory64";

/** a·b + c on f32x4 vectors. */
export type Madd = (a: string, b: string, c: string) => string;
export const relaxedMadd: Madd = (a, b, c) => `(f32x4.relaxed_madd ${a} ${b} ${c})`;
export const plainMadd: Madd = (a, b, c) => `(f32x4.add (f32x4.mul ${a} ${b}) ${c})`;

/**
 * A kernel parameter: `ptr` a byte offset in the arena, `int` a count, size or flag, `f32` a
 * float. Pointers and integers are the memory model's integer type (`Wat.I`); on Memory64 they
 * arrive as f64 (a JS number converts to it without a BigInt and holds any arena offset
 * exactly) and are truncated on entry to i64 locals of the same name.
 */
export interface Param {
  readonly name: string;
  readonly type: "ptr" | "int" | "f32";
  /** Supplied by the `WasmKernels` method itself (a scale, scratch), not by its caller. */
  readonly internal?: true;
}

/** A kernel's locals (declarations) and instructions, its parameters being declared for it. */
export interface Body {
  readonly locals: string;
  readonly code: string;
}

export interface Wat {
  readonly memory: MemoryModel;
  /** The integer type of addresses, sizes and counters: i32 on wasm32, i64 on Memory64. */
  readonly I: "i32" | "i64";
  readonly madd: Madd;
  /** Whether this is the relaxed-SIMD build (its int8 dot product, `relaxed_dot_i8x16_i7x16_add_s`). */
  readonly relaxed: boolean;
  /** An integer constant of type I. */
  int(n: number): string;
  add(a: string, b: string): string;
  mul(a: string, b: string): string;
  /** A `for (variable = from; variable + step <= limit; variable += step)` loop; leaves it at the remainder. */
  forLoop(label: string, variable: string, step: number, limit: string, body: string): string;
  /** The exported function `name` with `params`, declared for this memory model, around `body`. */
  func(name: string, params: readonly Param[], body: Body): string;
}

export const get = (name: string) => `(local.get $${name})`;
export const set = (name: string, value: string) => `(local.set $${name} ${value})`;
export const range = (n: number) => Array.from({ length: n }, (_, i) => i);

/** The shift count of a SIMD lane shift: i32 whatever the memory model, as SIMD requires. */
export const laneShift = (bits: number) => `(i32.const ${bits})`;

/** The sum of the four lanes of f32x4 local `v`, pairwise. */
export const hsum = (v: string) =>
  `(f32.add (f32.add (f32x4.extract_lane 0 ${get(v)}) (f32x4.extract_lane 1 ${get(v)})) (f32.add (f32x4.extract_lane 2 ${get(v)}) (f32x4.extract_lane 3 ${get(v)})))`;

export function wat(memory: MemoryModel, madd: Madd): Wat {
  const I = memory === "memory64" ? "i64" : "i32";
  const int = (n: number) => `(${I}.const ${n})`;
  const add = (a: string, b: string) => `(${I}.add ${a} ${b})`;
  return {
    memory,
    I,
    madd,
    relaxed: madd === relaxedMadd,
    int,
    add,
    mul: (a, b) => `(${I}.mul ${a} ${b})`,
    forLoop: (label, variable, step, limit, body) => `(block $${label}_done (loop $${label}
    (br_if $${label}_done (${I}.gt_u ${add(get(variable), int(step))} ${limit}))
    ${body}
    ${set(variable, add(get(variable), int(step)))}
    (br $${label})))`,
    func(name, params, { locals, code }) {
      const wide = memory === "memory64";
      const ints = params.filter((p) => p.type !== "f32").map((p) => p.name);
      const declared = params.map(({ name, type }) =>
        type === "f32"
          ? `(param $${name} f32)`
          : wide
            ? `(param $${name}_f64 f64)`
            : `(param $${name} i32)`,
      );
      // Memory64: the integer locals of the parameters follow the body's own locals.
      const entry = wide
        ? [
            ...ints.map((n) => `(local $${n} i64)`),
            ...ints.map((n) => set(n, `(i64.trunc_f64_u ${get(`${n}_f64`)})`)),
          ]
        : [];
      return `(func (export "${name}") ${declared.join(" ")}
    ${locals}
    ${entry.join(" ")}
    ${code})`;
    },
  };
}
