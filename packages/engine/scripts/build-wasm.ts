/**
 * Generates the WebAssembly text for the SIMD kernels and assembles it with wabt into two
 * committed binaries: one using relaxed-SIMD FMA, one plain SIMD. Run with node after changing
 * the kernels; installing the package needs no toolchain.
 */
import { writeFile } from "node:fs/promises";
import wabtInit from "wabt";

type Madd = (a: string, b: string, c: string) => string;
const relaxed: Madd = (a, b, c) => `(f32x4.relaxed_madd ${a} ${b} ${c})`;
const plain: Madd = (a, b, c) => `(f32x4.add (f32x4.mul ${a} ${b}) ${c})`;

const get = (name: string) => `(local.get $${name})`;
const set = (name: string, value: string) => `(local.set $${name} ${value})`;
const add = (a: string, b: string) => `(i32.add ${a} ${b})`;
const mul = (a: string, b: string) => `(i32.mul ${a} ${b})`;
const i32 = (n: number) => `(i32.const ${n})`;
const range = (n: number) => Array.from({ length: n }, (_, i) => i);
const hsum = (v: string) =>
  `(f32.add (f32.add (f32x4.extract_lane 0 ${get(v)}) (f32x4.extract_lane 1 ${get(v)})) (f32.add (f32x4.extract_lane 2 ${get(v)}) (f32x4.extract_lane 3 ${get(v)})))`;

/** A `for (var = from; var + step <= limit; var += step)` loop; leaves var at the remainder. */
function forLoop(
  label: string,
  variable: string,
  step: number,
  limit: string,
  body: string,
): string {
  return `(block $${label}_done (loop $${label}
    (br_if $${label}_done (i32.gt_u ${add(get(variable), i32(step))} ${limit}))
    ${body}
    ${set(variable, add(get(variable), i32(step)))}
    (br $${label})))`;
}

/** out[M,N] (+)= a[M,K]·b[N,K]ᵀ as RM×RN tiles of dot products; K must be a multiple of 4. */
function ntTile(madd: Madd, RM: number, RN: number): string {
  const accs = range(RM).flatMap((i) => range(RN).map((j) => `c${i}${j}`));
  return `
    ${accs.map((c) => set(c, "(v128.const i32x4 0 0 0 0)")).join("\n")}
    ${range(RM)
      .map((i) => set(`pa${i}`, add(get("a"), mul(add(get("m"), i32(i)), get("Kb")))))
      .join("\n")}
    ${range(RN)
      .map((j) => set(`pb${j}`, add(get("b"), mul(add(get("n"), i32(j)), get("Kb")))))
      .join("\n")}
    ${set("k", i32(0))}
    (loop $k_${RM}${RN}
      ${range(RM)
        .map((i) => set(`va${i}`, `(v128.load ${add(get(`pa${i}`), get("k"))})`))
        .join("\n")}
      ${range(RN)
        .map((j) => set(`vb${j}`, `(v128.load ${add(get(`pb${j}`), get("k"))})`))
        .join("\n")}
      ${range(RM)
        .flatMap((i) =>
          range(RN).map((j) =>
            set(`c${i}${j}`, madd(get(`va${i}`), get(`vb${j}`), get(`c${i}${j}`))),
          ),
        )
        .join("\n")}
      ${set("k", add(get("k"), i32(16)))}
      (br_if $k_${RM}${RN} (i32.lt_u ${get("k")} ${get("Kb")})))
    ${range(RM)
      .map((i) => {
        const row = add(
          get("out"),
          mul(add(mul(add(get("m"), i32(i)), get("N")), get("n")), i32(4)),
        );
        return `${set("po", row)}
        ${range(RN)
          .map(
            (j) =>
              `(f32.store offset=${j * 4} ${get("po")} (f32.add ${hsum(`c${i}${j}`)} (select (f32.load offset=${j * 4} ${get("po")}) (f32.const 0) ${get("acc")})))`,
          )
          .join("\n")}`;
      })
      .join("\n")}`;
}

function matmulNT(madd: Madd): string {
  const locals = [
    ...[
      "m",
      "n",
      "k",
      "Kb",
      "po",
      ...range(4).map((i) => `pa${i}`),
      ...range(4).map((j) => `pb${j}`),
    ].map((l) => `(local $${l} i32)`),
    ...[...range(4).map((i) => `va${i}`), ...range(4).map((j) => `vb${j}`)].map(
      (l) => `(local $${l} v128)`,
    ),
    ...range(4).flatMap((i) => range(4).map((j) => `(local $c${i}${j} v128)`)),
  ];
  const rows = (RM: number, label: string) => `
    ${set("n", i32(0))}
    ${forLoop(`${label}n4`, "n", 4, get("N"), ntTile(madd, RM, 4))}
    ${forLoop(`${label}n1`, "n", 1, get("N"), ntTile(madd, RM, 1))}`;
  return `(func (export "matmul_nt") (param $out i32) (param $a i32) (param $b i32) (param $M i32) (param $N i32) (param $K i32) (param $acc i32)
    ${locals.join(" ")}
    ${set("Kb", mul(get("K"), i32(4)))}
    ${set("m", i32(0))}
    ${forLoop("m4", "m", 4, get("M"), rows(4, "r4"))}
    ${forLoop("m1", "m", 1, get("M"), rows(1, "r1"))})`;
}

/**
 * out[M,N] (+)= Σ_k A(m,k)·b[k,N] with 8 output columns per tile (N must be a multiple of 8).
 * `transposedA` reads A from a [K,M] layout (weight gradients) instead of [M,K].
 */
function nnTile(madd: Madd, RM: number, transposedA: boolean): string {
  const accs = range(RM).flatMap((i) => [`c${i}0`, `c${i}1`]);
  const aAddress = (i: number) =>
    transposedA
      ? add(get("a"), mul(add(mul(get("k"), get("M")), add(get("m"), i32(i))), i32(4)))
      : add(get("a"), mul(add(mul(add(get("m"), i32(i)), get("K")), get("k")), i32(4)));
  return `
    ${range(RM)
      .map(
        (i) =>
          set(
            "po",
            add(get("out"), mul(add(mul(add(get("m"), i32(i)), get("N")), get("n")), i32(4))),
          ) +
          `
      ${set(`c${i}0`, `(select (v128.load ${get("po")}) (v128.const i32x4 0 0 0 0) ${get("acc")})`)}
      ${set(`c${i}1`, `(select (v128.load offset=16 ${get("po")}) (v128.const i32x4 0 0 0 0) ${get("acc")})`)}`,
      )
      .join("\n")}
    ${set("k", i32(0))}
    ${set("pb", add(get("b"), mul(get("n"), i32(4))))}
    (block $kd_${RM} (loop $k_${RM}
      (br_if $kd_${RM} (i32.ge_u ${get("k")} ${get("K")}))
      ${set("vb0", `(v128.load ${get("pb")})`)}
      ${set("vb1", `(v128.load offset=16 ${get("pb")})`)}
      ${range(RM)
        .map(
          (i) => `${set("va0", `(f32x4.splat (f32.load ${aAddress(i)}))`)}
        ${set(`c${i}0`, madd(get("va0"), get("vb0"), get(`c${i}0`)))}
        ${set(`c${i}1`, madd(get("va0"), get("vb1"), get(`c${i}1`)))}`,
        )
        .join("\n")}
      ${set("pb", add(get("pb"), get("Nb")))}
      ${set("k", add(get("k"), i32(1)))}
      (br $k_${RM})))
    ${accs.length > 0 ? "" : ""}
    ${range(RM)
      .map(
        (
          i,
        ) => `${set("po", add(get("out"), mul(add(mul(add(get("m"), i32(i)), get("N")), get("n")), i32(4))))}
      (v128.store ${get("po")} ${get(`c${i}0`)})
      (v128.store offset=16 ${get("po")} ${get(`c${i}1`)})`,
      )
      .join("\n")}`;
}

function matmulNN(madd: Madd, name: string, transposedA: boolean): string {
  const locals = [
    ...["m", "n", "k", "Nb", "po", "pb"].map((l) => `(local $${l} i32)`),
    ...["va0", "vb0", "vb1"].map((l) => `(local $${l} v128)`),
    ...range(4).flatMap((i) => [`(local $c${i}0 v128)`, `(local $c${i}1 v128)`]),
  ];
  const rows = (RM: number, label: string) => `
    ${set("n", i32(0))}
    ${forLoop(`${label}n8`, "n", 8, get("N"), nnTile(madd, RM, transposedA))}`;
  return `(func (export "${name}") (param $out i32) (param $a i32) (param $b i32) (param $M i32) (param $N i32) (param $K i32) (param $acc i32)
    ${locals.join(" ")}
    ${set("Nb", mul(get("N"), i32(4)))}
    ${set("m", i32(0))}
    ${forLoop("m4", "m", 4, get("M"), rows(4, "r4"))}
    ${forLoop("m1", "m", 1, get("M"), rows(1, "r1"))})`;
}

function module(madd: Madd): string {
  return `(module
  (memory (import "env" "memory") 1)
  ${matmulNT(madd)}
  ${matmulNN(madd, "matmul_nn", false)}
  ${matmulNN(madd, "matmul_tn", true)})`;
}

export async function assemble(): Promise<{ relaxed: Uint8Array; simd: Uint8Array }> {
  const wabt = await wabtInit();
  const build = (madd: Madd, name: string) => {
    const parsed = wabt.parseWat(name, module(madd), { simd: true, relaxed_simd: true });
    parsed.validate();
    return new Uint8Array(parsed.toBinary({}).buffer);
  };
  return { relaxed: build(relaxed, "relaxed.wat"), simd: build(plain, "simd.wat") };
}

if (import.meta.main) {
  const { relaxed: r, simd } = await assemble();
  const dir = new URL("../src/wasm/", import.meta.url);
  await writeFile(new URL("kernels-relaxed.wasm", dir), r);
  await writeFile(new URL("kernels-simd.wasm", dir), simd);
  console.log(
    `wrote kernels-relaxed.wasm (${r.length} B) and kernels-simd.wasm (${simd.length} B)`,
  );
}
