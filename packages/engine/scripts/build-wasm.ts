/**
 * Generates the WebAssembly text for the SIMD kernels and assembles it with wabt into two
 * committed binaries: one using relaxed-SIMD FMA, one plain SIMD. Run with node after changing
 * the kernels; installing the package needs no toolchain.
 */
import { writeFile } from "node:fs/promises";
import wabtInit from "wabt";
import { MAX_PAGES, MAX_PAGES_64 } from "../src/kernels/wasm/arena.ts";

type Madd = (a: string, b: string, c: string) => string;
const relaxed: Madd = (a, b, c) => `(f32x4.relaxed_madd ${a} ${b} ${c})`;
const plain: Madd = (a, b, c) => `(f32x4.add (f32x4.mul ${a} ${b}) ${c})`;

const get = (name: string) => `(local.get $${name})`;
const set = (name: string, value: string) => `(local.set $${name} ${value})`;
const add = (a: string, b: string) => `(i32.add ${a} ${b})`;
const mul = (a: string, b: string) => `(i32.mul ${a} ${b})`;
const i32 = (n: number) => `(i32.const ${n})`;
const range = (n: number) => Array.from({ length: n }, (_, i) => i);
/**
 * The shift count of a SIMD lane shift, which stays i32 in the memory64 build (see `memory64`).
 */
const laneShift = (bits: number) => `(i32.const ${bits} (;lane;))`;
const LANE16 = laneShift(16);
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

/**
 * GEMM on packed B panels: out[M,N] (+)= A·B, where B is held as panels of 8 columns, panel p
 * at `p + p·ps` bytes, laid out [K][8] (zero past N; see `pack`). Register tiles are MR rows ×
 * NP panels (6×1 for the bulk, wider for the last 1–5 rows so decode keeps 8–12 accumulators
 * in flight). Every output element is summed over k in order, from 0 or from its old value
 * when accumulating, whatever its tile: a row gives the same bits alone or in a batch, and
 * the rows can be split among threads without changing a bit. Columns are written in whole
 * panels, so `out` needs room for N rounded up to 8 per row (`ldo` bytes apart).
 * `transposedA`: A(m,k) at a + k·lda + 4m (weight gradients) instead of a + m·lda + 4k.
 * `bf16`: the panels hold BF16 numbers ([K][8] × 2 bytes, each row's columns stored in the
 * order 0 4 1 5 2 6 3 7; see `narrowBf16`), widened to F32 as they are loaded: BF16 is the top
 * half of an F32, so one shift gives columns 0–3 and one mask columns 4–7. A weight kept in
 * BF16 gives exactly the sums of its F32 widening.
 */
function gemm(madd: Madd, name: string, transposedA: boolean, bf16 = false): string {
  const stride = bf16 ? 16 : 32;
  const U = 4;
  const L = (n: string) => `(local.get $${n})`;
  const zero = "(v128.const i32x4 0 0 0 0)";
  /** `po` = row m + i of `out`, at column n. */
  const rowOut = (i: number) =>
    set("po", add(get("out"), add(mul(add(get("m"), i32(i)), get("ldo")), mul(get("n"), i32(4)))));
  /** k over [0, K): groups of U steps (after `each`), then single steps; labels from `label`. */
  const kLoop = (
    label: string,
    step: (u: number) => string,
    advance: (steps: number) => string,
    each = "",
  ) => `${set("k", i32(0))}
      (block $u${label}_d (loop $u${label}
        (br_if $u${label}_d (i32.gt_u ${add(L("k"), i32(U))} ${L("K")}))
        ${each}
        ${range(U).map(step).join("\n")}
        ${advance(U)}
        ${set("k", add(L("k"), i32(U)))}
        (br $u${label})))
      (block $t${label}_d (loop $t${label}
        (br_if $t${label}_d (i32.ge_u ${L("k")} ${L("K")}))
        ${step(0)}
        ${advance(1)}
        ${set("k", add(L("k"), i32(1)))}
        (br $t${label})))`;
  const tile = (MR: number, NP: number): string => {
    const acc = (i: number, j: number, v: number) => `c${i}_${j}_${v}`;
    const label = `${MR}_${NP}`;
    const eachAcc = (f: (j: number, v: number) => string) =>
      range(NP)
        .flatMap((j) => range(2).map((v) => f(j, v)))
        .join("\n");
    const init = range(MR)
      .map(
        (i) => `${rowOut(i)}
        ${eachAcc((j, v) => set(acc(i, j, v), `(select (v128.load offset=${j * 32 + v * 16} ${L("po")}) ${zero} (i32.ne ${L("acc")} (i32.const 0)))`))}`,
      )
      .join("\n");
    const pointers = [
      ...(transposedA
        ? [set("pa0", add(get("a"), mul(get("m"), i32(4))))]
        : range(MR).map((i) =>
            set(`pa${i}`, add(get("a"), mul(add(get("m"), i32(i)), get("lda")))),
          )),
      ...range(NP).map((j) =>
        set(
          `pb${j}`,
          add(get("p"), mul(add(`(i32.shr_u ${L("n")} (i32.const 3))`, i32(j)), get("ps"))),
        ),
      ),
    ].join("\n");
    // One k step, `u` steps into the unrolled group (immediate offsets where the layout allows).
    const step = (u: number): string => {
      const aAt = (i: number) =>
        transposedA
          ? `(v128.load32_splat offset=${i * 4} ${L(u === 0 ? "pa0" : `pk${u}`)})`
          : `(v128.load32_splat offset=${u * 4} ${L(`pa${i}`)})`;
      const lines: string[] = [];
      if (transposedA && u > 0)
        lines.push(set(`pk${u}`, add(L(u === 1 ? "pa0" : `pk${u - 1}`), L("lda"))));
      if (MR === 1) lines.push(set("s", aAt(0)));
      for (let j = 0; j < NP; j++) {
        if (bf16) {
          lines.push(set("b1", `(v128.load offset=${u * 16} ${L(`pb${j}`)})`));
          lines.push(set("b0", `(i32x4.shl ${L("b1")} ${LANE16})`));
          lines.push(set("b1", `(v128.and ${L("b1")} ${L("hi")})`));
        } else {
          lines.push(set("b0", `(v128.load offset=${u * 32} ${L(`pb${j}`)})`));
          lines.push(set("b1", `(v128.load offset=${u * 32 + 16} ${L(`pb${j}`)})`));
        }
        for (let i = 0; i < MR; i++) {
          if (MR > 1) lines.push(set("s", aAt(i)));
          lines.push(set(acc(i, j, 0), madd(L("s"), L("b0"), L(acc(i, j, 0)))));
          lines.push(set(acc(i, j, 1), madd(L("s"), L("b1"), L(acc(i, j, 1)))));
        }
      }
      return lines.join("\n");
    };
    const advance = (steps: number) =>
      [
        ...(transposedA
          ? [set("pa0", add(L(steps === 1 ? "pa0" : `pk${steps - 1}`), L("lda")))]
          : range(MR).map((i) => set(`pa${i}`, add(L(`pa${i}`), i32(steps * 4))))),
        ...range(NP).map((j) => set(`pb${j}`, add(L(`pb${j}`), i32(steps * stride)))),
      ].join("\n");
    const store = range(MR)
      .map(
        (i) => `${rowOut(i)}
        ${eachAcc((j, v) => `(v128.store offset=${j * 32 + v * 16} ${L("po")} ${L(acc(i, j, v))})`)}`,
      )
      .join("\n");
    return `${init}
      ${pointers}
      ${kLoop(label, step, advance)}
      ${store}`;
  };
  /**
   * A few rows more than a 6-row tile (7–12: decoding that many sequences) against one panel,
   * half of it at a time: one accumulator per row for columns 0–3 over every k, then again for
   * columns 4–7 (the panel, read again, is in cache by then). The weight streams from memory
   * once for all the rows, where 6-row tiles read it twice, and each sum still runs over k in
   * order, so the bits are those of any other tile.
   */
  const halfTile = (MR: number, half: number): string => {
    const label = `h${MR}_${half}`;
    // F32 panels (twice the bytes per k) measured slower with the touches; BF16 ones 1.6× faster.
    const PREFETCH = bf16 ? PREFETCH_PANELS : 0;
    const init = range(MR)
      .map(
        (i) => `${rowOut(i)}
        ${set(`h${i}`, `(select (v128.load offset=${half * 16} ${L("po")}) ${zero} (i32.ne ${L("acc")} (i32.const 0)))`)}`,
      )
      .join("\n");
    // Touching the next panels' rows as this one streams keeps several reads from memory in
    // flight (one panel alone is latency-bound); past the last panel they touch this one. The
    // pointers reuse the pk locals, which only the transposed-A tiles use otherwise.
    const ahead = (j: number) =>
      set(
        `pk${j}`,
        `(select ${add(L("pb0"), mul(i32(j), L("ps")))} ${L("pb0")} (i32.lt_u ${add(L("n"), i32(8 * j))} ${L("N8")}))`,
      );
    const pointers = [
      ...range(MR).map((i) => set(`pa${i}`, add(get("a"), mul(add(get("m"), i32(i)), get("lda"))))),
      set("pb0", add(get("p"), mul(`(i32.shr_u ${L("n")} (i32.const 3))`, get("ps")))),
      ...(half === 0 ? range(PREFETCH).map((j) => ahead(j + 1)) : []),
    ].join("\n");
    const step = (u: number): string => {
      const lines: string[] = [];
      if (bf16) {
        lines.push(set("b0", `(v128.load offset=${u * 16} ${L("pb0")})`));
        lines.push(
          set(
            "b0",
            half === 0 ? `(i32x4.shl ${L("b0")} ${LANE16})` : `(v128.and ${L("b0")} ${L("hi")})`,
          ),
        );
      } else {
        lines.push(set("b0", `(v128.load offset=${u * 32 + half * 16} ${L("pb0")})`));
      }
      for (let i = 0; i < MR; i++) {
        lines.push(set("s", `(v128.load32_splat offset=${u * 4} ${L(`pa${i}`)})`));
        lines.push(set(`h${i}`, madd(L("s"), L("b0"), L(`h${i}`))));
      }
      return lines.join("\n");
    };
    const advance = (steps: number) =>
      [
        ...range(MR).map((i) => set(`pa${i}`, add(L(`pa${i}`), i32(steps * 4)))),
        set("pb0", add(L("pb0"), i32(steps * stride))),
        ...(half === 0
          ? range(PREFETCH).map((j) => set(`pk${j + 1}`, add(L(`pk${j + 1}`), i32(steps * stride))))
          : []),
      ].join("\n");
    // One touch per cache line of each panel ahead, per unrolled group of k.
    const touches =
      half === 0
        ? range(PREFETCH)
            .flatMap((j) =>
              range((U * stride) / 64).map(
                (c) => `(drop (i32.load offset=${c * 64} ${L(`pk${j + 1}`)}))`,
              ),
            )
            .join("\n")
        : "";
    const store = range(MR)
      .map(
        (i) => `${rowOut(i)}
        (v128.store offset=${half * 16} ${L("po")} ${L(`h${i}`)})`,
      )
      .join("\n");
    return `${init}
      ${pointers}
      ${kLoop(label, step, advance, touches)}
      ${store}`;
  };
  /** Every panel for the MR (7–12) rows of a small batch, by halves (`halfTile`). */
  const halfPanels = (MR: number) => `${set("n", i32(0))}
      ${forLoop(`hp${MR}`, "n", 8, L("N8"), `${halfTile(MR, 0)}\n${halfTile(MR, 1)}`)}`;
  /** All panels for MR rows starting at m: NP panels per tile, then one at a time. */
  const panels = (MR: number, NP: number) => `${set("n", i32(0))}
      ${NP > 1 ? forLoop(`w${MR}`, "n", NP * 8, L("N8"), tile(MR, NP)) : ""}
      ${forLoop(`n${MR}`, "n", 8, L("N8"), tile(MR, 1))}`;
  const widths: Record<number, number> = { 1: 4, 2: 3, 3: 2, 4: 1, 5: 1 };
  const locals = [
    ...["m", "n", "k", "N8", "po", ...range(HALF_ROWS).map((i) => `pa${i}`)]
      .concat(
        range(4).map((j) => `pb${j}`),
        range(U).map((u) => `pk${u}`),
      )
      .map((l) => `(local $${l} i32)`),
    ...["s", "b0", "b1", "hi"].map((l) => `(local $${l} v128)`),
    ...range(6).flatMap((i) =>
      range(4).flatMap((j) => range(2).map((v) => `(local $c${i}_${j}_${v} v128)`)),
    ),
    ...(transposedA ? [] : range(HALF_ROWS).map((i) => `(local $h${i} v128)`)),
  ];
  const sixRowTiles = `${forLoop("m6", "m", 6, L("M"), panels(6, 1))}
    ${[5, 4, 3, 2, 1]
      .map(
        (r) =>
          `(if (i32.eq (i32.sub ${L("M")} ${L("m")}) ${i32(r)}) (then ${panels(r, widths[r]!)}))`,
      )
      .join("\n")}`;
  // Weight gradients (transposed A) have many rows; small batches take the half-panel tiles.
  const body = transposedA
    ? sixRowTiles
    : `(if (i32.lt_u (i32.sub ${L("M")} ${i32(7)}) ${i32(HALF_ROWS - 6)})
      (then ${range(HALF_ROWS - 6)
        .map((i) => `(if (i32.eq ${L("M")} ${i32(7 + i)}) (then ${halfPanels(7 + i)}))`)
        .join("\n")})
      (else ${sixRowTiles}))`;
  return `(func (export "${name}") (param $out i32) (param $ldo i32) (param $a i32) (param $lda i32) (param $p i32) (param $ps i32)
      (param $M i32) (param $N i32) (param $K i32) (param $acc i32)
    ${locals.join(" ")}
    ${set("N8", `(i32.and ${add(L("N"), i32(7))} (i32.const -8))`)}
    ${bf16 ? set("hi", HIGH_HALVES) : ""}
    ${set("m", i32(0))}
    ${body})`;
}

/** The most rows `gemm` computes with half-panel tiles (from 7; see `halfTile`). */
const HALF_ROWS = 12;
/** Panels ahead that a half-panel tile on BF16 panels touches as it streams one. */
const PREFETCH_PANELS = 2;

const HIGH_HALVES = "(v128.const i32x4 0xffff0000 0xffff0000 0xffff0000 0xffff0000)";

/**
 * Narrows n F32 values (n a multiple of 8: whole panel rows) at src to BF16 at dst, rounding to
 * nearest even (NaN is not kept apart: weights are finite), each row of 8 stored in the order
 * 0 4 1 5 2 6 3 7, so that `gemm` widens a row with a shift and a mask: column c (c < 4) is
 * the low half of 32-bit lane c, column c + 4 its high half.
 */
function narrowBf16(): string {
  const round = (v: string) =>
    `(i32x4.add (i32x4.add ${v} (v128.const i32x4 0x7fff 0x7fff 0x7fff 0x7fff))
      (v128.and (i32x4.shr_u ${v} ${LANE16}) (v128.const i32x4 1 1 1 1)))`;
  return `(func (export "narrow_bf16") (param $dst i32) (param $src i32) (param $n i32)
    (local $i i32) (local $a v128) (local $b v128)
    ${forLoop(
      "nb",
      "i",
      8,
      "(local.get $n)",
      `${set("a", "(v128.load (i32.add (local.get $src) (i32.shl (local.get $i) (i32.const 2))))")}
      ${set("b", "(v128.load offset=16 (i32.add (local.get $src) (i32.shl (local.get $i) (i32.const 2))))")}
      (v128.store (i32.add (local.get $dst) (i32.shl (local.get $i) (i32.const 1)))
        (v128.or (i32x4.shr_u ${round("(local.get $a)")} ${LANE16})
          (v128.and ${round("(local.get $b)")} ${HIGH_HALVES})))`,
    )})`;
}

/**
 * Widens n BF16 values (n a multiple of 8: whole panel rows, in `narrowBf16`'s order) at src to
 * F32 panel rows at dst: what `gemm` reads, for products of many rows, where widening a weight
 * once costs less than widening it in every tile.
 */
function widenBf16(): string {
  return `(func (export "widen_bf16") (param $dst i32) (param $src i32) (param $n i32)
    (local $i i32) (local $v v128) (local $hi v128)
    ${set("hi", HIGH_HALVES)}
    ${forLoop(
      "wb",
      "i",
      8,
      "(local.get $n)",
      `${set("v", "(v128.load (i32.add (local.get $src) (i32.shl (local.get $i) (i32.const 1))))")}
      (v128.store (i32.add (local.get $dst) (i32.shl (local.get $i) (i32.const 2)))
        (i32x4.shl (local.get $v) ${LANE16}))
      (v128.store offset=16 (i32.add (local.get $dst) (i32.shl (local.get $i) (i32.const 2)))
        (v128.and (local.get $v) (local.get $hi)))`,
    )})`;
}

/** i8x16.shuffle of two vectors' 32-bit lanes (0–3 the first's, 4–7 the second's). */
const lanes = (a: string, b: string, picks: number[]) =>
  `(i8x16.shuffle ${picks.flatMap((l) => [4 * l, 4 * l + 1, 4 * l + 2, 4 * l + 3]).join(" ")} ${a} ${b})`;

/**
 * The B-panels of a weight kept as W-panels (for dX = dY·W): every whole 8×8 block of the
 * first `panels` W-panels (K rows of 8 weight rows each; BF16 ones in `narrowBf16`'s order),
 * for the first `blocks` blocks of 8 k, transposed to F32 rows of 8 k at
 * dst + (j·N·8 + p·64)·4 (block j of k, panel p). The caller does the partial blocks.
 */
function weightToB(bf16: boolean): string {
  const L = (n: string) => `(local.get $${n})`;
  const row = (k: number, half: number) => `r${k}_${half}`;
  // The 8 k rows of the block, each as two F32 vectors: weight rows 0–3 and 4–7.
  const loads = range(8)
    .map((k) =>
      bf16
        ? `${set("v", `(v128.load offset=${k * 16} ${L("ps")})`)}
        ${set(row(k, 0), `(i32x4.shl ${L("v")} ${LANE16})`)}
        ${set(row(k, 1), `(v128.and ${L("v")} ${HIGH_HALVES})`)}`
        : `${set(row(k, 0), `(v128.load offset=${k * 32} ${L("ps")})`)}
        ${set(row(k, 1), `(v128.load offset=${k * 32 + 16} ${L("ps")})`)}`,
    )
    .join("\n");
  // A 4×4 transpose: k rows k0…k0+3, weight rows 4·half + i (lane i), become output rows
  // 4·half + i, at the column offset of k0. Row i takes lane i of the four k rows.
  const quarter = (k0: number, half: number) => {
    const [a, b, c, d] = range(4).map((i) => L(row(k0 + i, half)));
    const out = (i: number, v: string) =>
      `(v128.store offset=${(4 * half + i) * 32 + (k0 / 4) * 16} ${L("pd")} ${v})`;
    return `${set("t0", lanes(a!, b!, [0, 4, 1, 5]))}
      ${set("t1", lanes(a!, b!, [2, 6, 3, 7]))}
      ${set("t2", lanes(c!, d!, [0, 4, 1, 5]))}
      ${set("t3", lanes(c!, d!, [2, 6, 3, 7]))}
      ${out(0, lanes(L("t0"), L("t2"), [0, 1, 4, 5]))}
      ${out(1, lanes(L("t0"), L("t2"), [2, 3, 6, 7]))}
      ${out(2, lanes(L("t1"), L("t3"), [0, 1, 4, 5]))}
      ${out(3, lanes(L("t1"), L("t3"), [2, 3, 6, 7]))}`;
  };
  const panelBytes = bf16 ? 16 : 32;
  return `(func (export "${bf16 ? "weight_to_b_bf16" : "weight_to_b"}") (param $dst i32) (param $src i32) (param $panels i32) (param $blocks i32) (param $K i32) (param $N i32)
    (local $p i32) (local $j i32) (local $ps i32) (local $pd i32) (local $v v128)
    (local $t0 v128) (local $t1 v128) (local $t2 v128) (local $t3 v128)
    ${range(8)
      .flatMap((k) => [0, 1].map((h) => `(local $${row(k, h)} v128)`))
      .join(" ")}
    ${forLoop(
      "wp",
      "p",
      1,
      L("panels"),
      `${set("j", i32(0))}
      ${forLoop(
        "wj",
        "j",
        1,
        L("blocks"),
        `${set("ps", add(L("src"), mul(i32(panelBytes), add(mul(L("p"), L("K")), mul(L("j"), i32(8))))))}
        ${set("pd", add(L("dst"), mul(i32(4), add(mul(mul(L("j"), L("N")), i32(8)), mul(L("p"), i32(64))))))}
        ${loads}
        ${[0, 4].flatMap((k0) => [0, 1].map((h) => quarter(k0, h))).join("\n")}`,
      )}`,
    )})`;
}

/**
 * Packs B into the panels `gemm` reads: [ceil(N/8)][K][8] floats, `ps` bytes per panel, zero
 * past N. `fromWeight`: the source is a Linear weight W[N,K] (B = Wᵀ) instead of B[K,N].
 */
function pack(name: string, fromWeight: boolean): string {
  const L = (n: string) => `(local.get $${n})`;
  const at = (col: string) =>
    fromWeight
      ? `(i32.add ${L("src")} (i32.shl (i32.add (i32.mul ${col} ${L("K")}) ${L("k")}) (i32.const 2)))`
      : `(i32.add ${L("src")} (i32.shl (i32.add (i32.mul ${L("k")} ${L("N")}) ${col}) (i32.const 2)))`;
  // B[K,N] with a whole panel in range: two vector copies per k.
  const whole = fromWeight
    ? ""
    : `(if (i32.le_u ${add(L("n"), i32(8))} ${L("N")}) (then
          (v128.store ${L("pd")} (v128.load ${at(L("n"))}))
          (v128.store offset=16 ${L("pd")} (v128.load offset=16 ${at(L("n"))}))
          ${set("pd", add(L("pd"), i32(32)))}
          ${set("k", add(L("k"), i32(1)))}
          (br $kl)))`;
  return `(func (export "${name}") (param $dst i32) (param $src i32) (param $N i32) (param $K i32) (param $ps i32)
    (local $n i32) (local $k i32) (local $j i32) (local $pd i32)
    (block $nd (loop $nl
      (br_if $nd (i32.ge_u ${L("n")} ${L("N")}))
      ${set("pd", add(L("dst"), mul(`(i32.shr_u ${L("n")} (i32.const 3))`, L("ps"))))}
      ${set("k", i32(0))}
      (block $kd (loop $kl
        (br_if $kd (i32.ge_u ${L("k")} ${L("K")}))
        ${whole}
        ${set("j", i32(0))}
        (block $jd (loop $jl
          (br_if $jd (i32.ge_u ${L("j")} (i32.const 8)))
          (if (i32.lt_u ${add(L("n"), L("j"))} ${L("N")})
            (then (f32.store ${L("pd")} (f32.load ${at(add(L("n"), L("j")))})))
            (else (f32.store ${L("pd")} (f32.const 0))))
          ${set("pd", add(L("pd"), i32(4)))}
          ${set("j", add(L("j"), i32(1)))}
          (br $jl)))
        ${set("k", add(L("k"), i32(1)))}
        (br $kl)))
      ${set("n", add(L("n"), i32(8)))}
      (br $nl))))`;
}

/** e^x for x ≤ 88: 2^n · p(r), r = x − n·ln2, degree-6 polynomial (≈1e-7 relative error). */
function expFunction(madd: Madd): string {
  const c = (v: number) => `(v128.const f32x4 ${v} ${v} ${v} ${v})`;
  return `(func $exp (param $x v128) (result v128) (local $n v128) (local $r v128) (local $p v128)
    (local.set $x (f32x4.min (f32x4.max (local.get $x) ${c(-87.3)}) ${c(88.7)}))
    (local.set $n (f32x4.nearest (f32x4.mul (local.get $x) ${c(Math.LOG2E)})))
    (local.set $r (f32x4.sub (local.get $x) (f32x4.mul (local.get $n) ${c(0.693145751953125)})))
    (local.set $r (f32x4.sub (local.get $r) (f32x4.mul (local.get $n) ${c(1.428606765330187e-6)})))
    (local.set $p ${c(1 / 720)})
    ${[1 / 120, 1 / 24, 1 / 6, 0.5, 1, 1].map((k) => `(local.set $p ${madd("(local.get $p)", "(local.get $r)", c(k))})`).join("\n    ")}
    (f32x4.mul (local.get $p)
      (i32x4.shl (i32x4.add (i32x4.trunc_sat_f32x4_s (local.get $n)) (v128.const i32x4 127 127 127 127)) ${laneShift(23)})))`;
}

/** out[r] = x[r] · w / rms(x[r]), and inv[r] = 1 / rms(x[r]); D must be a multiple of 4. */
function rmsNorm(madd: Madd): string {
  return `(func (export "rms_norm") (param $out i32) (param $inv i32) (param $x i32) (param $w i32) (param $rows i32) (param $D i32) (param $eps f32)
    (local $r i32) (local $i i32) (local $Db i32) (local $px i32) (local $po i32) (local $acc v128) (local $s f32) (local $vs v128)
    (local.set $Db (i32.mul (local.get $D) (i32.const 4)))
    (block $done (loop $rows
      (br_if $done (i32.ge_u (local.get $r) (local.get $rows)))
      (local.set $px (i32.add (local.get $x) (i32.mul (local.get $r) (local.get $Db))))
      (local.set $po (i32.add (local.get $out) (i32.mul (local.get $r) (local.get $Db))))
      (local.set $acc (v128.const i32x4 0 0 0 0))
      (local.set $i (i32.const 0))
      (block $d1 (loop $sum
        (br_if $d1 (i32.ge_u (local.get $i) (local.get $Db)))
        (local.set $vs (v128.load (i32.add (local.get $px) (local.get $i))))
        (local.set $acc ${madd("(local.get $vs)", "(local.get $vs)", "(local.get $acc)")})
        (local.set $i (i32.add (local.get $i) (i32.const 16)))
        (br $sum)))
      (local.set $s (f32.div (f32.const 1) (f32.sqrt (f32.add (f32.div ${hsum("acc")} (f32.convert_i32_u (local.get $D))) (local.get $eps)))))
      (f32.store (i32.add (local.get $inv) (i32.shl (local.get $r) (i32.const 2))) (local.get $s))
      (local.set $vs (f32x4.splat (local.get $s)))
      (local.set $i (i32.const 0))
      (block $d2 (loop $scale
        (br_if $d2 (i32.ge_u (local.get $i) (local.get $Db)))
        (v128.store (i32.add (local.get $po) (local.get $i))
          (f32x4.mul (f32x4.mul (v128.load (i32.add (local.get $px) (local.get $i))) (local.get $vs)) (v128.load (i32.add (local.get $w) (local.get $i)))))
        (local.set $i (i32.add (local.get $i) (i32.const 16)))
        (br $scale)))
      (local.set $r (i32.add (local.get $r) (i32.const 1)))
      (br $rows))))`;
}

/**
 * Backward of out = x·w·s (s = 1/rms(x), saved in inv): dx[r] = s·w·dy − x·s³·(Σ dy·w·x)/D.
 * The weight's gradient is `rms_norm_dw`, a sum over rows kept apart so rows can be split.
 */
function rmsNormBackward(madd: Madd): string {
  const L = (n: string) => `(local.get $${n})`;
  const row = (base: string) => add(L(base), mul(L("r"), L("Db")));
  return `(func (export "rms_norm_backward") (param $dx i32) (param $dy i32) (param $x i32) (param $inv i32) (param $w i32) (param $rows i32) (param $D i32)
    (local $r i32) (local $i i32) (local $Db i32) (local $px i32) (local $py i32) (local $po i32) (local $acc v128) (local $s f32) (local $vs v128) (local $vc v128)
    ${set("Db", mul(L("D"), i32(4)))}
    ${forLoop(
      "rows",
      "r",
      1,
      L("rows"),
      `${set("px", row("x"))}
      ${set("py", row("dy"))}
      ${set("po", row("dx"))}
      ${set("s", `(f32.load (i32.add ${L("inv")} (i32.shl ${L("r")} (i32.const 2))))`)}
      ${set("acc", "(v128.const i32x4 0 0 0 0)")}
      ${set("i", i32(0))}
      ${forLoop("dot", "i", 16, L("Db"), set("acc", madd(`(f32x4.mul (v128.load ${add(L("py"), L("i"))}) (v128.load ${add(L("w"), L("i"))}))`, `(v128.load ${add(L("px"), L("i"))})`, L("acc"))))}
      ${set("vs", `(f32x4.splat ${L("s")})`)}
      ${set("vc", `(f32x4.splat (f32.div (f32.mul ${hsum("acc")} (f32.mul ${L("s")} (f32.mul ${L("s")} ${L("s")}))) (f32.convert_i32_u ${L("D")})))`)}
      ${set("i", i32(0))}
      ${forLoop(
        "dx",
        "i",
        16,
        L("Db"),
        `(v128.store ${add(L("po"), L("i"))} (f32x4.sub (f32x4.mul (f32x4.mul ${L("vs")} (v128.load ${add(L("w"), L("i"))})) (v128.load ${add(L("py"), L("i"))}))
          (f32x4.mul (v128.load ${add(L("px"), L("i"))}) ${L("vc")})))`,
      )}`,
    )})`;
}

/** dw += Σ_r dy[r]·x[r]·inv[r], rows in order (D a multiple of 4). */
function rmsNormDw(madd: Madd): string {
  const L = (n: string) => `(local.get $${n})`;
  return `(func (export "rms_norm_dw") (param $dw i32) (param $dy i32) (param $x i32) (param $inv i32) (param $rows i32) (param $D i32)
    (local $r i32) (local $i i32) (local $Db i32) (local $o i32) (local $vs v128)
    ${set("Db", mul(L("D"), i32(4)))}
    ${forLoop(
      "rows",
      "r",
      1,
      L("rows"),
      `${set("o", mul(L("r"), L("Db")))}
      ${set("vs", `(f32x4.splat (f32.load (i32.add ${L("inv")} (i32.shl ${L("r")} (i32.const 2)))))`)}
      ${set("i", i32(0))}
      ${forLoop(
        "cols",
        "i",
        16,
        L("Db"),
        `(v128.store ${add(L("dw"), L("i"))} ${madd(`(f32x4.mul (v128.load ${add(L("dy"), add(L("o"), L("i")))}) (v128.load ${add(L("x"), add(L("o"), L("i")))}))`, L("vs"), `(v128.load ${add(L("dw"), L("i"))})`)})`,
      )}`,
    )})`;
}

/** out = silu(gate) · up over n elements (n a multiple of 4). */
function swiglu(): string {
  return `(func (export "swiglu") (param $out i32) (param $gate i32) (param $up i32) (param $n i32)
    (local $i i32) (local $nb i32) (local $g v128)
    (local.set $nb (i32.mul (local.get $n) (i32.const 4)))
    (block $done (loop $l
      (br_if $done (i32.ge_u (local.get $i) (local.get $nb)))
      (local.set $g (v128.load (i32.add (local.get $gate) (local.get $i))))
      (v128.store (i32.add (local.get $out) (local.get $i))
        (f32x4.mul (f32x4.div (local.get $g) (f32x4.add (v128.const f32x4 1 1 1 1) (call $exp (f32x4.neg (local.get $g)))))
          (v128.load (i32.add (local.get $up) (local.get $i)))))
      (local.set $i (i32.add (local.get $i) (i32.const 16)))
      (br $l))))`;
}

/** Shared pieces of the attention kernels, which walk keys in groups of 4 then singly. */
const A = (n: string) => `(local.get $${n})`;
const attentionLocals = `(local $t i32) (local $h i32) (local $j i32) (local $i i32) (local $span i32) (local $hdb i32)
    (local $kvb i32) (local $qb i32) (local $group i32) (local $kvh i32) (local $max f32) (local $sum f32) (local $s f32)
    (local $e v128) (local $ps i32) (local $d v128) (local $qv v128) (local $tv v128)
    ${range(4)
      .map(
        (r) => `(local $a${r} v128) (local $pv${r} v128) (local $kp${r} i32) (local $xp${r} i32)`,
      )
      .join(" ")}`;
/** Loops `j` over [0, span) in groups of R = 4 while they fit, then one at a time. */
const keyGroups = (label: string, body: (R: number) => string) => `${set("j", i32(0))}
        ${forLoop(`${label}4`, "j", 4, A("span"), body(4))}
        ${forLoop(`${label}1`, "j", 1, A("span"), body(1))}`;
/** `$name_r` = base + (j + r)·kvb: row j + r of a [span, KV·hd] operand (at the head's column). */
const rowPtrs = (R: number, name: string, base: string) =>
  range(R)
    .map((r) => set(`${name}${r}`, add(A(base), mul(add(A("j"), i32(r)), A("kvb")))))
    .join("\n");
const scoreAt = (r: number) => add(A("scores"), `(i32.shl ${add(A("j"), i32(r))} (i32.const 2))`);
const vecLoop = (label: string, body: string) => `${set("i", i32(0))}
          (block $${label}d (loop $${label}l
            (br_if $${label}d (i32.ge_u ${A("i")} ${A("hdb")}))
            ${body}
            ${set("i", add(A("i"), i32(16)))}
            (br $${label}l)))`;
const at = (ptr: string) => `(i32.add ${A(ptr)} ${A("i")})`;
/** scores[j] = q·k_j·scale for R keys at once (R accumulators), tracking the maximum. */
const scoreGroup = (madd: Madd, R: number) => `${rowPtrs(R, "kp", "pk")}
          ${range(R)
            .map((r) => set(`a${r}`, "(v128.const i32x4 0 0 0 0)"))
            .join("\n")}
          ${vecLoop(
            `s${R}`,
            `${set("qv", `(v128.load ${at("pq")})`)}
            ${range(R)
              .map((r) => set(`a${r}`, madd(A("qv"), `(v128.load ${at(`kp${r}`)})`, A(`a${r}`))))
              .join("\n")}`,
          )}
          ${range(R)
            .map(
              (r) => `${set("s", `(f32.mul ${hsum(`a${r}`)} ${A("scale")})`)}
          (f32.store ${scoreAt(r)} ${A("s")})
          ${set("max", `(f32.max ${A("max")} ${A("s")})`)}`,
            )
            .join("\n")}`;
/** Scores of row t against keys 0..span−1 for head h, then exponentials and their sum. */
const scoresAndExps = (madd: Madd) => `${set("max", "(f32.const -inf)")}
        ${keyGroups("sc", (R) => scoreGroup(madd, R))}
        ;; exponentials (padded to a multiple of 4; the padding is excluded from the sum)
        ${set("sum", "(f32.const 0)")}
        ${set("j", i32(0))}
        (block $ed (loop $el
          (br_if $ed (i32.ge_u ${A("j")} ${A("span")}))
          ${set("ps", scoreAt(0))}
          ${set("e", `(call $exp (f32x4.sub (v128.load ${A("ps")}) (f32x4.splat ${A("max")})))`)}
          (v128.store ${A("ps")} ${A("e")})
          ${range(4)
            .map((lane) =>
              lane === 0
                ? set("sum", `(f32.add ${A("sum")} (f32x4.extract_lane 0 ${A("e")}))`)
                : `(if (i32.lt_u ${add(A("j"), i32(lane))} ${A("span")}) (then ${set("sum", `(f32.add ${A("sum")} (f32x4.extract_lane ${lane} ${A("e")}))`)}))`,
            )
            .join("\n")}
          ${set("j", add(A("j"), i32(4)))}
          (br $el)))`;
const attentionSetup = `${set("hdb", mul(A("hd"), i32(4)))}
    ${set("kvb", mul(A("KV"), A("hdb")))}
    ${set("qb", mul(A("H"), A("hdb")))}
    ${set("group", `(i32.div_u ${A("H")} ${A("KV")})`)}`;
/** Pointer to row t, head h of a [n, H·hd] operand. */
const headRow = (base: string) => add(A(base), add(mul(A("t"), A("qb")), mul(A("h"), A("hdb"))));

/**
 * Causal attention of n new rows (positions start..start+n−1) against keys/values [span, kvDim];
 * q and out are [n, H·hd]. scores is scratch of at least start+n floats (+4).
 * Softmax is unnormalised during the weighted sum, then scaled by 1/Σ.
 */
function attention(madd: Madd): string {
  return `(func (export "attention") (param $out i32) (param $q i32) (param $k i32) (param $v i32) (param $n i32) (param $start i32)
      (param $H i32) (param $KV i32) (param $hd i32) (param $scale f32) (param $scores i32)
    ${attentionLocals} (local $pq i32) (local $pk i32) (local $po i32)
    ${attentionSetup}
    ${set("t", i32(0))}
    ${forLoop(
      "tl",
      "t",
      1,
      A("n"),
      `${set("span", add(add(A("start"), A("t")), i32(1)))}
      ${set("h", i32(0))}
      ${forLoop(
        "hl",
        "h",
        1,
        A("H"),
        `${set("pq", headRow("q"))}
        ${set("kvh", mul(`(i32.div_u ${A("h")} ${A("group")})`, A("hdb")))}
        ${set("pk", add(A("k"), A("kvh")))}
        ${scoresAndExps(madd)}
        ;; weighted sum of values, R at a time
        ${set("po", headRow("out"))}
        ${vecLoop("z", `(v128.store ${at("po")} (v128.const i32x4 0 0 0 0))`)}
        ${set("pk", add(A("v"), A("kvh")))}
        ${keyGroups(
          "wv",
          (R) => `${rowPtrs(R, "kp", "pk")}
          ${range(R)
            .map((r) => set(`pv${r}`, `(f32x4.splat (f32.load ${scoreAt(r)}))`))
            .join("\n")}
          ${vecLoop(
            `v${R}`,
            `${set("tv", `(v128.load ${at("po")})`)}
            ${range(R)
              .map((r) => set("tv", madd(A(`pv${r}`), `(v128.load ${at(`kp${r}`)})`, A("tv"))))
              .join("\n")}
            (v128.store ${at("po")} ${A("tv")})`,
          )}`,
        )}
        ${set("pv0", `(f32x4.splat (f32.div (f32.const 1) ${A("sum")}))`)}
        ${vecLoop("nz", `(v128.store ${at("po")} (f32x4.mul (v128.load ${at("po")}) ${A("pv0")}))`)}`,
      )}`,
    )})`;
}

/**
 * Backward of causal self-attention over one sequence of n rows (positions 0..n−1), recomputing
 * the probabilities instead of storing them. Adds into dq [n, H·hd] and dk, dv [n, KV·hd].
 */
function attentionBackward(madd: Madd): string {
  return `(func (export "attention_backward") (param $dq i32) (param $dk i32) (param $dv i32) (param $q i32) (param $k i32) (param $v i32)
      (param $dout i32) (param $n i32) (param $H i32) (param $KV i32) (param $hd i32) (param $scale f32) (param $scores i32) (param $dps i32)
    ${attentionLocals} (local $pq i32) (local $pk i32) (local $pv i32) (local $pdo i32) (local $pdq i32) (local $pdk i32) (local $pdv i32)
    (local $dot f32) (local $inv f32) (local $p f32) (local $dp f32)
    ${attentionSetup}
    ${set("t", i32(0))}
    ${forLoop(
      "tl",
      "t",
      1,
      A("n"),
      `${set("span", add(A("t"), i32(1)))}
      ${set("h", i32(0))}
      ${forLoop(
        "hl",
        "h",
        1,
        A("H"),
        `${set("pq", headRow("q"))}
        ${set("pdo", headRow("dout"))}
        ${set("pdq", headRow("dq"))}
        ${set("kvh", mul(`(i32.div_u ${A("h")} ${A("group")})`, A("hdb")))}
        ${set("pk", add(A("k"), A("kvh")))}
        ${set("pv", add(A("v"), A("kvh")))}
        ${set("pdk", add(A("dk"), A("kvh")))}
        ${set("pdv", add(A("dv"), A("kvh")))}
        ${scoresAndExps(madd)}
        ${set("inv", `(f32.div (f32.const 1) ${A("sum")})`)}
        ;; dP_j = dout·v_j; dv_j += p_j·dout; dot = Σ p_j dP_j
        ${set("dot", "(f32.const 0)")}
        ${keyGroups(
          "dv",
          (R) => `${rowPtrs(R, "kp", "pv")}
          ${rowPtrs(R, "xp", "pdv")}
          ${range(R)
            .map(
              (r) => `${set("p", `(f32.mul (f32.load ${scoreAt(r)}) ${A("inv")})`)}
          (f32.store ${scoreAt(r)} ${A("p")})
          ${set(`pv${r}`, `(f32x4.splat ${A("p")})`)}
          ${set(`a${r}`, "(v128.const i32x4 0 0 0 0)")}`,
            )
            .join("\n")}
          ${vecLoop(
            `g${R}`,
            `${set("d", `(v128.load ${at("pdo")})`)}
            ${range(R)
              .map(
                (r) => `${set(`a${r}`, madd(A("d"), `(v128.load ${at(`kp${r}`)})`, A(`a${r}`)))}
            (v128.store ${at(`xp${r}`)} ${madd(A(`pv${r}`), A("d"), `(v128.load ${at(`xp${r}`)})`)})`,
              )
              .join("\n")}`,
          )}
          ${range(R)
            .map(
              (r) => `${set("dp", hsum(`a${r}`))}
          (f32.store ${add(A("dps"), `(i32.shl ${add(A("j"), i32(r))} (i32.const 2))`)} ${A("dp")})
          ${set("dot", `(f32.add ${A("dot")} (f32.mul (f32x4.extract_lane 0 ${A(`pv${r}`)}) ${A("dp")}))`)}`,
            )
            .join("\n")}`,
        )}
        ;; dS_j = p_j (dP_j − dot)·scale; dq += dS_j k_j; dk_j += dS_j q
        ${keyGroups(
          "dk",
          (R) => `${rowPtrs(R, "kp", "pk")}
          ${rowPtrs(R, "xp", "pdk")}
          ${range(R)
            .map((r) =>
              set(
                `pv${r}`,
                `(f32x4.splat (f32.mul (f32.mul (f32.load ${scoreAt(r)}) (f32.sub (f32.load ${add(A("dps"), `(i32.shl ${add(A("j"), i32(r))} (i32.const 2))`)}) ${A("dot")})) ${A("scale")}))`,
              ),
            )
            .join("\n")}
          ${vecLoop(
            `k${R}`,
            `${set("qv", `(v128.load ${at("pq")})`)}
            ${set("tv", `(v128.load ${at("pdq")})`)}
            ${range(R)
              .map(
                (r) => `${set("tv", madd(A(`pv${r}`), `(v128.load ${at(`kp${r}`)})`, A("tv")))}
            (v128.store ${at(`xp${r}`)} ${madd(A(`pv${r}`), A("qv"), `(v128.load ${at(`xp${r}`)})`)})`,
              )
              .join("\n")}
            (v128.store ${at("pdq")} ${A("tv")})`,
          )}`,
        )}`,
      )}`,
    )})`;
}

/** dGate, dUp of out = silu(gate)·up given dOut (n a multiple of 4). */
function swigluBackward(): string {
  return `(func (export "swiglu_backward") (param $dgate i32) (param $dup i32) (param $dout i32) (param $gate i32) (param $up i32) (param $n i32)
    (local $i i32) (local $nb i32) (local $g v128) (local $s v128) (local $d v128)
    (local.set $nb (i32.mul (local.get $n) (i32.const 4)))
    (block $done (loop $l
      (br_if $done (i32.ge_u (local.get $i) (local.get $nb)))
      (local.set $g (v128.load (i32.add (local.get $gate) (local.get $i))))
      (local.set $d (v128.load (i32.add (local.get $dout) (local.get $i))))
      (local.set $s (f32x4.div (v128.const f32x4 1 1 1 1) (f32x4.add (v128.const f32x4 1 1 1 1) (call $exp (f32x4.neg (local.get $g))))))
      (v128.store (i32.add (local.get $dup) (local.get $i)) (f32x4.mul (local.get $d) (f32x4.mul (local.get $g) (local.get $s))))
      (v128.store (i32.add (local.get $dgate) (local.get $i))
        (f32x4.mul (f32x4.mul (local.get $d) (v128.load (i32.add (local.get $up) (local.get $i))))
          (f32x4.mul (local.get $s) (f32x4.add (v128.const f32x4 1 1 1 1) (f32x4.mul (local.get $g) (f32x4.sub (v128.const f32x4 1 1 1 1) (local.get $s)))))))
      (local.set $i (i32.add (local.get $i) (i32.const 16)))
      (br $l))))`;
}

/** Row-wise x ← softmax(x)·scale[r]; writes each row's max and Σexp (cols a multiple of 4). */
function softmaxRows(): string {
  return `(func (export "softmax_rows") (param $x i32) (param $rows i32) (param $cols i32) (param $scale i32) (param $rmax i32) (param $rsum i32)
    (local $r i32) (local $i i32) (local $cb i32) (local $px i32) (local $m v128) (local $e v128) (local $acc v128) (local $max f32) (local $f v128)
    (local.set $cb (i32.mul (local.get $cols) (i32.const 4)))
    (block $done (loop $rl
      (br_if $done (i32.ge_u (local.get $r) (local.get $rows)))
      (local.set $px (i32.add (local.get $x) (i32.mul (local.get $r) (local.get $cb))))
      (local.set $m (v128.const f32x4 -inf -inf -inf -inf))
      (local.set $i (i32.const 0))
      (block $d1 (loop $l1
        (br_if $d1 (i32.ge_u (local.get $i) (local.get $cb)))
        (local.set $m (f32x4.max (local.get $m) (v128.load (i32.add (local.get $px) (local.get $i)))))
        (local.set $i (i32.add (local.get $i) (i32.const 16)))
        (br $l1)))
      (local.set $max (f32.max (f32.max (f32x4.extract_lane 0 (local.get $m)) (f32x4.extract_lane 1 (local.get $m)))
        (f32.max (f32x4.extract_lane 2 (local.get $m)) (f32x4.extract_lane 3 (local.get $m)))))
      (local.set $m (f32x4.splat (local.get $max)))
      (local.set $acc (v128.const i32x4 0 0 0 0))
      (local.set $i (i32.const 0))
      (block $d2 (loop $l2
        (br_if $d2 (i32.ge_u (local.get $i) (local.get $cb)))
        (local.set $e (call $exp (f32x4.sub (v128.load (i32.add (local.get $px) (local.get $i))) (local.get $m))))
        (v128.store (i32.add (local.get $px) (local.get $i)) (local.get $e))
        (local.set $acc (f32x4.add (local.get $acc) (local.get $e)))
        (local.set $i (i32.add (local.get $i) (i32.const 16)))
        (br $l2)))
      (f32.store (i32.add (local.get $rmax) (i32.shl (local.get $r) (i32.const 2))) (local.get $max))
      (f32.store (i32.add (local.get $rsum) (i32.shl (local.get $r) (i32.const 2))) ${hsum("acc")})
      (local.set $f (f32x4.splat (f32.div (f32.load (i32.add (local.get $scale) (i32.shl (local.get $r) (i32.const 2)))) ${hsum("acc")})))
      (local.set $i (i32.const 0))
      (block $d3 (loop $l3
        (br_if $d3 (i32.ge_u (local.get $i) (local.get $cb)))
        (v128.store (i32.add (local.get $px) (local.get $i)) (f32x4.mul (v128.load (i32.add (local.get $px) (local.get $i))) (local.get $f)))
        (local.set $i (i32.add (local.get $i) (i32.const 16)))
        (br $l3)))
      (local.set $r (i32.add (local.get $r) (i32.const 1)))
      (br $rl))))`;
}

function module(madd: Madd, wide: boolean): string {
  const text = `(module
  (memory (import "env" "memory") ${wide ? `i64 1 ${MAX_PAGES_64}` : `1 ${MAX_PAGES}`} shared)
  ${expFunction(madd)}
  ${gemm(madd, "gemm", false)}
  ${gemm(madd, "gemm_at", true)}
  ${gemm(madd, "gemm_bf16", false, true)}
  ${narrowBf16()}
  ${widenBf16()}
  ${weightToB(false)}
  ${weightToB(true)}
  ${pack("pack_b", false)}
  ${pack("pack_w", true)}
  ${rmsNorm(madd)}
  ${rmsNormBackward(madd)}
  ${rmsNormDw(madd)}
  ${swiglu()}
  ${attention(madd)}
  ${attentionBackward(madd)}
  ${swigluBackward()}
  ${softmaxRows()})`;
  return wide ? memory64(text) : text;
}

/**
 * Rewrites the wasm32 kernels for a 64-bit memory: every integer (addresses, sizes, counters)
 * becomes i64, so that one operand may lie past 4 GiB. Integer parameters arrive as f64, which a
 * JS number converts to without a BigInt and which holds any arena offset exactly, and are
 * truncated to i64 locals of the same name on entry; the callers are unchanged. Lane shift
 * counts (`laneShift`) stay i32, as SIMD requires.
 */
function memory64(text: string): string {
  return text
    .split(/(?=\(func )/)
    .map((part) => {
      if (!part.startsWith("(func ")) return part;
      // The declarations (params, result, locals) run up to the first instruction.
      const head =
        /^\(func (?:\(export "\w+"\)|\$\w+)(?:\s*\((?:param|result|local) [^()]*\))*/.exec(
          part,
        )![0];
      const ints = [...head.matchAll(/\(param \$(\w+) i32\)/g)].map((m) => m[1]!);
      const declared = head.replace(/\(param \$(\w+) i32\)/g, "(param $$$1_f64 f64)");
      const entry = ints
        .map((name) => `(local $${name} i64)`)
        .concat(
          ints.map((name) => `(local.set $${name} (i64.trunc_f64_u (local.get $${name}_f64)))`),
        )
        .join(" ");
      return `${declared} ${entry}${part.slice(head.length)}`;
    })
    .join("")
    .replace(/\(i32\.const (\d+) \(;lane;\)\)/g, "(LANE $1)")
    .replace(/\bi32\.(?=[a-z])/g, "i64.")
    .replace(/\(local \$(\w+) i32\)/g, "(local $$$1 i64)")
    .replace(/convert_i32_u/g, "convert_i64_u")
    .replace(/\(LANE (\d+)\)/g, "(i32.const $1)");
}

/** The four kernel binaries, by file name: relaxed or plain SIMD, on a wasm32 or memory64 arena. */
export async function assemble(): Promise<Record<string, Uint8Array>> {
  const wabt = await wabtInit();
  const build = (madd: Madd, wide: boolean, name: string) => {
    const features = { simd: true, relaxed_simd: true, threads: true, memory64: wide };
    const parsed = wabt.parseWat(name, module(madd, wide), features);
    // wabt's types omit validate's feature argument; without it, shared memory is rejected.
    (parsed.validate as (f: typeof features) => void)(features);
    return new Uint8Array(parsed.toBinary({}).buffer);
  };
  return {
    "kernels-relaxed.wasm": build(relaxed, false, "relaxed.wat"),
    "kernels-simd.wasm": build(plain, false, "simd.wat"),
    "kernels-relaxed-64.wasm": build(relaxed, true, "relaxed-64.wat"),
    "kernels-simd-64.wasm": build(plain, true, "simd-64.wat"),
  };
}

if (import.meta.main) {
  const dir = new URL("../src/kernels/wasm/", import.meta.url);
  for (const [file, bytes] of Object.entries(await assemble())) {
    await writeFile(new URL(file, dir), bytes);
    console.log(`wrote ${file} (${bytes.length} B)`);
  }
}
