/**
 * The kernels' bodies in WebAssembly text, each written once against a `Wat` (memory model and
 * multiply-add) and declared with its parameters in the kernel table (`../table.ts`), which
 * wraps each in its function. Only the build (`scripts/build-wasm.ts`) runs them.
 */
import { type Body, get, hsum, laneShift, range, set, type Wat } from "./wat.ts";

const LANE16 = laneShift(16);

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
export function gemm(w: Wat, transposedA: boolean, bf16 = false): Body {
  const { I, int, add, mul, forLoop, madd } = w;
  const stride = bf16 ? 16 : 32;
  const U = 4;
  const zero = "(v128.const i32x4 0 0 0 0)";
  /** `po` = row m + i of `out`, at column n. */
  const rowOut = (i: number) =>
    set("po", add(get("out"), add(mul(add(get("m"), int(i)), get("ldo")), mul(get("n"), int(4)))));
  /** k over [0, K): groups of U steps (after `each`), then single steps; labels from `label`. */
  const kLoop = (
    label: string,
    step: (u: number) => string,
    advance: (steps: number) => string,
    each = "",
  ) => `${set("k", int(0))}
      (block $u${label}_d (loop $u${label}
        (br_if $u${label}_d (${I}.gt_u ${add(get("k"), int(U))} ${get("K")}))
        ${each}
        ${range(U).map(step).join("\n")}
        ${advance(U)}
        ${set("k", add(get("k"), int(U)))}
        (br $u${label})))
      (block $t${label}_d (loop $t${label}
        (br_if $t${label}_d (${I}.ge_u ${get("k")} ${get("K")}))
        ${step(0)}
        ${advance(1)}
        ${set("k", add(get("k"), int(1)))}
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
        ${eachAcc((j, v) => set(acc(i, j, v), `(select (v128.load offset=${j * 32 + v * 16} ${get("po")}) ${zero} (${I}.ne ${get("acc")} (${I}.const 0)))`))}`,
      )
      .join("\n");
    const pointers = [
      ...(transposedA
        ? [set("pa0", add(get("a"), mul(get("m"), int(4))))]
        : range(MR).map((i) =>
            set(`pa${i}`, add(get("a"), mul(add(get("m"), int(i)), get("lda")))),
          )),
      ...range(NP).map((j) =>
        set(
          `pb${j}`,
          add(get("p"), mul(add(`(${I}.shr_u ${get("n")} (${I}.const 3))`, int(j)), get("ps"))),
        ),
      ),
    ].join("\n");
    // One k step, `u` steps into the unrolled group (immediate offsets where the layout allows).
    const step = (u: number): string => {
      const aAt = (i: number) =>
        transposedA
          ? `(v128.load32_splat offset=${i * 4} ${get(u === 0 ? "pa0" : `pk${u}`)})`
          : `(v128.load32_splat offset=${u * 4} ${get(`pa${i}`)})`;
      const lines: string[] = [];
      if (transposedA && u > 0)
        lines.push(set(`pk${u}`, add(get(u === 1 ? "pa0" : `pk${u - 1}`), get("lda"))));
      if (MR === 1) lines.push(set("s", aAt(0)));
      for (let j = 0; j < NP; j++) {
        if (bf16) {
          lines.push(set("b1", `(v128.load offset=${u * 16} ${get(`pb${j}`)})`));
          lines.push(set("b0", `(i32x4.shl ${get("b1")} ${LANE16})`));
          lines.push(set("b1", `(v128.and ${get("b1")} ${get("hi")})`));
        } else {
          lines.push(set("b0", `(v128.load offset=${u * 32} ${get(`pb${j}`)})`));
          lines.push(set("b1", `(v128.load offset=${u * 32 + 16} ${get(`pb${j}`)})`));
        }
        for (let i = 0; i < MR; i++) {
          if (MR > 1) lines.push(set("s", aAt(i)));
          lines.push(set(acc(i, j, 0), madd(get("s"), get("b0"), get(acc(i, j, 0)))));
          lines.push(set(acc(i, j, 1), madd(get("s"), get("b1"), get(acc(i, j, 1)))));
        }
      }
      return lines.join("\n");
    };
    const advance = (steps: number) =>
      [
        ...(transposedA
          ? [set("pa0", add(get(steps === 1 ? "pa0" : `pk${steps - 1}`), get("lda")))]
          : range(MR).map((i) => set(`pa${i}`, add(get(`pa${i}`), int(steps * 4))))),
        ...range(NP).map((j) => set(`pb${j}`, add(get(`pb${j}`), int(steps * stride)))),
      ].join("\n");
    const store = range(MR)
      .map(
        (i) => `${rowOut(i)}
        ${eachAcc((j, v) => `(v128.store offset=${j * 32 + v * 16} ${get("po")} ${get(acc(i, j, v))})`)}`,
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
        ${set(`h${i}`, `(select (v128.load offset=${half * 16} ${get("po")}) ${zero} (${I}.ne ${get("acc")} (${I}.const 0)))`)}`,
      )
      .join("\n");
    // Touching the next panels' rows as this one streams keeps several reads from memory in
    // flight (one panel alone is latency-bound); past the last panel they touch this one. The
    // pointers reuse the pk locals, which only the transposed-A tiles use otherwise.
    const ahead = (j: number) =>
      set(
        `pk${j}`,
        `(select ${add(get("pb0"), mul(int(j), get("ps")))} ${get("pb0")} (${I}.lt_u ${add(get("n"), int(8 * j))} ${get("N8")}))`,
      );
    const pointers = [
      ...range(MR).map((i) => set(`pa${i}`, add(get("a"), mul(add(get("m"), int(i)), get("lda"))))),
      set("pb0", add(get("p"), mul(`(${I}.shr_u ${get("n")} (${I}.const 3))`, get("ps")))),
      ...(half === 0 ? range(PREFETCH).map((j) => ahead(j + 1)) : []),
    ].join("\n");
    const step = (u: number): string => {
      const lines: string[] = [];
      if (bf16) {
        lines.push(set("b0", `(v128.load offset=${u * 16} ${get("pb0")})`));
        lines.push(
          set(
            "b0",
            half === 0
              ? `(i32x4.shl ${get("b0")} ${LANE16})`
              : `(v128.and ${get("b0")} ${get("hi")})`,
          ),
        );
      } else {
        lines.push(set("b0", `(v128.load offset=${u * 32 + half * 16} ${get("pb0")})`));
      }
      for (let i = 0; i < MR; i++) {
        lines.push(set("s", `(v128.load32_splat offset=${u * 4} ${get(`pa${i}`)})`));
        lines.push(set(`h${i}`, madd(get("s"), get("b0"), get(`h${i}`))));
      }
      return lines.join("\n");
    };
    const advance = (steps: number) =>
      [
        ...range(MR).map((i) => set(`pa${i}`, add(get(`pa${i}`), int(steps * 4)))),
        set("pb0", add(get("pb0"), int(steps * stride))),
        ...(half === 0
          ? range(PREFETCH).map((j) =>
              set(`pk${j + 1}`, add(get(`pk${j + 1}`), int(steps * stride))),
            )
          : []),
      ].join("\n");
    // One touch per cache line of each panel ahead, per unrolled group of k.
    const touches =
      half === 0
        ? range(PREFETCH)
            .flatMap((j) =>
              range((U * stride) / 64).map(
                (c) => `(drop (${I}.load offset=${c * 64} ${get(`pk${j + 1}`)}))`,
              ),
            )
            .join("\n")
        : "";
    const store = range(MR)
      .map(
        (i) => `${rowOut(i)}
        (v128.store offset=${half * 16} ${get("po")} ${get(`h${i}`)})`,
      )
      .join("\n");
    return `${init}
      ${pointers}
      ${kLoop(label, step, advance, touches)}
      ${store}`;
  };
  /** Every panel for the MR (7–12) rows of a small batch, by halves (`halfTile`). */
  const halfPanels = (MR: number) => `${set("n", int(0))}
      ${forLoop(`hp${MR}`, "n", 8, get("N8"), `${halfTile(MR, 0)}\n${halfTile(MR, 1)}`)}`;
  /** All panels for MR rows starting at m: NP panels per tile, then one at a time. */
  const panels = (MR: number, NP: number) => `${set("n", int(0))}
      ${NP > 1 ? forLoop(`w${MR}`, "n", NP * 8, get("N8"), tile(MR, NP)) : ""}
      ${forLoop(`n${MR}`, "n", 8, get("N8"), tile(MR, 1))}`;
  const widths: Record<number, number> = { 1: 4, 2: 3, 3: 2, 4: 1, 5: 1 };
  const locals = [
    ...["m", "n", "k", "N8", "po", ...range(HALF_ROWS).map((i) => `pa${i}`)]
      .concat(
        range(4).map((j) => `pb${j}`),
        range(U).map((u) => `pk${u}`),
      )
      .map((l) => `(local $${l} ${I})`),
    ...["s", "b0", "b1", "hi"].map((l) => `(local $${l} v128)`),
    ...range(6).flatMap((i) =>
      range(4).flatMap((j) => range(2).map((v) => `(local $c${i}_${j}_${v} v128)`)),
    ),
    ...(transposedA ? [] : range(HALF_ROWS).map((i) => `(local $h${i} v128)`)),
  ];
  const sixRowTiles = `${forLoop("m6", "m", 6, get("M"), panels(6, 1))}
    ${[5, 4, 3, 2, 1]
      .map(
        (r) =>
          `(if (${I}.eq (${I}.sub ${get("M")} ${get("m")}) ${int(r)}) (then ${panels(r, widths[r]!)}))`,
      )
      .join("\n")}`;
  // Weight gradients (transposed A) have many rows; small batches take the half-panel tiles.
  const body = transposedA
    ? sixRowTiles
    : `(if (${I}.lt_u (${I}.sub ${get("M")} ${int(7)}) ${int(HALF_ROWS - 6)})
      (then ${range(HALF_ROWS - 6)
        .map((i) => `(if (${I}.eq ${get("M")} ${int(7 + i)}) (then ${halfPanels(7 + i)}))`)
        .join("\n")})
      (else ${sixRowTiles}))`;
  return {
    locals: locals.join(" "),
    code: `${set("N8", `(${I}.and ${add(get("N"), int(7))} (${I}.const -8))`)}
    ${bf16 ? set("hi", HIGH_HALVES) : ""}
    ${set("m", int(0))}
    ${body}`,
  };
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
export function narrowBf16(w: Wat): Body {
  const { I, forLoop } = w;
  const round = (v: string) =>
    `(i32x4.add (i32x4.add ${v} (v128.const i32x4 0x7fff 0x7fff 0x7fff 0x7fff))
      (v128.and (i32x4.shr_u ${v} ${LANE16}) (v128.const i32x4 1 1 1 1)))`;
  return {
    locals: `(local $i ${I}) (local $a v128) (local $b v128)`,
    code: forLoop(
      "nb",
      "i",
      8,
      "(local.get $n)",
      `${set("a", `(v128.load (${I}.add (local.get $src) (${I}.shl (local.get $i) (${I}.const 2))))`)}
      ${set("b", `(v128.load offset=16 (${I}.add (local.get $src) (${I}.shl (local.get $i) (${I}.const 2))))`)}
      (v128.store (${I}.add (local.get $dst) (${I}.shl (local.get $i) (${I}.const 1)))
        (v128.or (i32x4.shr_u ${round("(local.get $a)")} ${LANE16})
          (v128.and ${round("(local.get $b)")} ${HIGH_HALVES})))`,
    ),
  };
}

/**
 * Widens n BF16 values (n a multiple of 8: whole panel rows, in `narrowBf16`'s order) at src to
 * F32 panel rows at dst: what `gemm` reads, for products of many rows, where widening a weight
 * once costs less than widening it in every tile.
 */
export function widenBf16(w: Wat): Body {
  const { I, forLoop } = w;
  return {
    locals: `(local $i ${I}) (local $v v128) (local $hi v128)`,
    code: `${set("hi", HIGH_HALVES)}
    ${forLoop(
      "wb",
      "i",
      8,
      "(local.get $n)",
      `${set("v", `(v128.load (${I}.add (local.get $src) (${I}.shl (local.get $i) (${I}.const 1))))`)}
      (v128.store (${I}.add (local.get $dst) (${I}.shl (local.get $i) (${I}.const 2)))
        (i32x4.shl (local.get $v) ${LANE16}))
      (v128.store offset=16 (${I}.add (local.get $dst) (${I}.shl (local.get $i) (${I}.const 2)))
        (v128.and (local.get $v) (local.get $hi)))`,
    )}`,
  };
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
export function weightToB(w: Wat, bf16: boolean): Body {
  const { I, int, add, mul, forLoop } = w;
  const row = (k: number, half: number) => `r${k}_${half}`;
  // The 8 k rows of the block, each as two F32 vectors: weight rows 0–3 and 4–7.
  const loads = range(8)
    .map((k) =>
      bf16
        ? `${set("v", `(v128.load offset=${k * 16} ${get("ps")})`)}
        ${set(row(k, 0), `(i32x4.shl ${get("v")} ${LANE16})`)}
        ${set(row(k, 1), `(v128.and ${get("v")} ${HIGH_HALVES})`)}`
        : `${set(row(k, 0), `(v128.load offset=${k * 32} ${get("ps")})`)}
        ${set(row(k, 1), `(v128.load offset=${k * 32 + 16} ${get("ps")})`)}`,
    )
    .join("\n");
  // A 4×4 transpose: k rows k0…k0+3, weight rows 4·half + i (lane i), become output rows
  // 4·half + i, at the column offset of k0. Row i takes lane i of the four k rows.
  const quarter = (k0: number, half: number) => {
    const [a, b, c, d] = range(4).map((i) => get(row(k0 + i, half)));
    const out = (i: number, v: string) =>
      `(v128.store offset=${(4 * half + i) * 32 + (k0 / 4) * 16} ${get("pd")} ${v})`;
    return `${set("t0", lanes(a!, b!, [0, 4, 1, 5]))}
      ${set("t1", lanes(a!, b!, [2, 6, 3, 7]))}
      ${set("t2", lanes(c!, d!, [0, 4, 1, 5]))}
      ${set("t3", lanes(c!, d!, [2, 6, 3, 7]))}
      ${out(0, lanes(get("t0"), get("t2"), [0, 1, 4, 5]))}
      ${out(1, lanes(get("t0"), get("t2"), [2, 3, 6, 7]))}
      ${out(2, lanes(get("t1"), get("t3"), [0, 1, 4, 5]))}
      ${out(3, lanes(get("t1"), get("t3"), [2, 3, 6, 7]))}`;
  };
  const panelBytes = bf16 ? 16 : 32;
  return {
    locals: `(local $p ${I}) (local $j ${I}) (local $ps ${I}) (local $pd ${I}) (local $v v128)
    (local $t0 v128) (local $t1 v128) (local $t2 v128) (local $t3 v128)
    ${range(8)
      .flatMap((k) => [0, 1].map((h) => `(local $${row(k, h)} v128)`))
      .join(" ")}`,
    code: forLoop(
      "wp",
      "p",
      1,
      get("panels"),
      `${set("j", int(0))}
      ${forLoop(
        "wj",
        "j",
        1,
        get("blocks"),
        `${set("ps", add(get("src"), mul(int(panelBytes), add(mul(get("p"), get("K")), mul(get("j"), int(8))))))}
        ${set("pd", add(get("dst"), mul(int(4), add(mul(mul(get("j"), get("N")), int(8)), mul(get("p"), int(64))))))}
        ${loads}
        ${[0, 4].flatMap((k0) => [0, 1].map((h) => quarter(k0, h))).join("\n")}`,
      )}`,
    ),
  };
}

/**
 * Packs B into the panels `gemm` reads: [ceil(N/8)][K][8] floats, `ps` bytes per panel, zero
 * past N. `fromWeight`: the source is a Linear weight W[N,K] (B = Wᵀ) instead of B[K,N].
 */
export function pack(w: Wat, fromWeight: boolean): Body {
  const { I, int, add, mul } = w;
  const at = (col: string) =>
    fromWeight
      ? `(${I}.add ${get("src")} (${I}.shl (${I}.add (${I}.mul ${col} ${get("K")}) ${get("k")}) (${I}.const 2)))`
      : `(${I}.add ${get("src")} (${I}.shl (${I}.add (${I}.mul ${get("k")} ${get("N")}) ${col}) (${I}.const 2)))`;
  // B[K,N] with a whole panel in range: two vector copies per k.
  const whole = fromWeight
    ? ""
    : `(if (${I}.le_u ${add(get("n"), int(8))} ${get("N")}) (then
          (v128.store ${get("pd")} (v128.load ${at(get("n"))}))
          (v128.store offset=16 ${get("pd")} (v128.load offset=16 ${at(get("n"))}))
          ${set("pd", add(get("pd"), int(32)))}
          ${set("k", add(get("k"), int(1)))}
          (br $kl)))`;
  return {
    locals: `(local $n ${I}) (local $k ${I}) (local $j ${I}) (local $pd ${I})`,
    code: `(block $nd (loop $nl
      (br_if $nd (${I}.ge_u ${get("n")} ${get("N")}))
      ${set("pd", add(get("dst"), mul(`(${I}.shr_u ${get("n")} (${I}.const 3))`, get("ps"))))}
      ${set("k", int(0))}
      (block $kd (loop $kl
        (br_if $kd (${I}.ge_u ${get("k")} ${get("K")}))
        ${whole}
        ${set("j", int(0))}
        (block $jd (loop $jl
          (br_if $jd (${I}.ge_u ${get("j")} (${I}.const 8)))
          (if (${I}.lt_u ${add(get("n"), get("j"))} ${get("N")})
            (then (f32.store ${get("pd")} (f32.load ${at(add(get("n"), get("j")))})))
            (else (f32.store ${get("pd")} (f32.const 0))))
          ${set("pd", add(get("pd"), int(4)))}
          ${set("j", add(get("j"), int(1)))}
          (br $jl)))
        ${set("k", add(get("k"), int(1)))}
        (br $kl)))
      ${set("n", add(get("n"), int(8)))}
      (br $nl)))`,
  };
}

/** e^x for x ≤ 88: 2^n · p(r), r = x − n·ln2, degree-6 polynomial (≈1e-7 relative error). */
export function expFunction({ madd }: Wat): string {
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
export function rmsNorm({ I, madd }: Wat): Body {
  return {
    locals: `(local $r ${I}) (local $i ${I}) (local $Db ${I}) (local $px ${I}) (local $po ${I}) (local $acc v128) (local $s f32) (local $vs v128)`,
    code: `(local.set $Db (${I}.mul (local.get $D) (${I}.const 4)))
    (block $done (loop $rows
      (br_if $done (${I}.ge_u (local.get $r) (local.get $rows)))
      (local.set $px (${I}.add (local.get $x) (${I}.mul (local.get $r) (local.get $Db))))
      (local.set $po (${I}.add (local.get $out) (${I}.mul (local.get $r) (local.get $Db))))
      (local.set $acc (v128.const i32x4 0 0 0 0))
      (local.set $i (${I}.const 0))
      (block $d1 (loop $sum
        (br_if $d1 (${I}.ge_u (local.get $i) (local.get $Db)))
        (local.set $vs (v128.load (${I}.add (local.get $px) (local.get $i))))
        (local.set $acc ${madd("(local.get $vs)", "(local.get $vs)", "(local.get $acc)")})
        (local.set $i (${I}.add (local.get $i) (${I}.const 16)))
        (br $sum)))
      (local.set $s (f32.div (f32.const 1) (f32.sqrt (f32.add (f32.div ${hsum("acc")} (f32.convert_${I}_u (local.get $D))) (local.get $eps)))))
      (f32.store (${I}.add (local.get $inv) (${I}.shl (local.get $r) (${I}.const 2))) (local.get $s))
      (local.set $vs (f32x4.splat (local.get $s)))
      (local.set $i (${I}.const 0))
      (block $d2 (loop $scale
        (br_if $d2 (${I}.ge_u (local.get $i) (local.get $Db)))
        (v128.store (${I}.add (local.get $po) (local.get $i))
          (f32x4.mul (f32x4.mul (v128.load (${I}.add (local.get $px) (local.get $i))) (local.get $vs)) (v128.load (${I}.add (local.get $w) (local.get $i)))))
        (local.set $i (${I}.add (local.get $i) (${I}.const 16)))
        (br $scale)))
      (local.set $r (${I}.add (local.get $r) (${I}.const 1)))
      (br $rows)))`,
  };
}

/**
 * Backward of out = x·w·s (s = 1/rms(x), saved in inv): dx[r] = s·w·dy − x·s³·(Σ dy·w·x)/D.
 * The weight's gradient is `rms_norm_dw`, a sum over rows kept apart so rows can be split.
 */
export function rmsNormBackward(w: Wat): Body {
  const { I, int, add, mul, forLoop, madd } = w;
  const row = (base: string) => add(get(base), mul(get("r"), get("Db")));
  return {
    locals: `(local $r ${I}) (local $i ${I}) (local $Db ${I}) (local $px ${I}) (local $py ${I}) (local $po ${I}) (local $acc v128) (local $s f32) (local $vs v128) (local $vc v128)`,
    code: `${set("Db", mul(get("D"), int(4)))}
    ${forLoop(
      "rows",
      "r",
      1,
      get("rows"),
      `${set("px", row("x"))}
      ${set("py", row("dy"))}
      ${set("po", row("dx"))}
      ${set("s", `(f32.load (${I}.add ${get("inv")} (${I}.shl ${get("r")} (${I}.const 2))))`)}
      ${set("acc", "(v128.const i32x4 0 0 0 0)")}
      ${set("i", int(0))}
      ${forLoop("dot", "i", 16, get("Db"), set("acc", madd(`(f32x4.mul (v128.load ${add(get("py"), get("i"))}) (v128.load ${add(get("w"), get("i"))}))`, `(v128.load ${add(get("px"), get("i"))})`, get("acc"))))}
      ${set("vs", `(f32x4.splat ${get("s")})`)}
      ${set("vc", `(f32x4.splat (f32.div (f32.mul ${hsum("acc")} (f32.mul ${get("s")} (f32.mul ${get("s")} ${get("s")}))) (f32.convert_${I}_u ${get("D")})))`)}
      ${set("i", int(0))}
      ${forLoop(
        "dx",
        "i",
        16,
        get("Db"),
        `(v128.store ${add(get("po"), get("i"))} (f32x4.sub (f32x4.mul (f32x4.mul ${get("vs")} (v128.load ${add(get("w"), get("i"))})) (v128.load ${add(get("py"), get("i"))}))
          (f32x4.mul (v128.load ${add(get("px"), get("i"))}) ${get("vc")})))`,
      )}`,
    )}`,
  };
}

/** dw += Σ_r dy[r]·x[r]·inv[r], rows in order (D a multiple of 4). */
export function rmsNormDw(w: Wat): Body {
  const { I, int, add, mul, forLoop, madd } = w;
  return {
    locals: `(local $r ${I}) (local $i ${I}) (local $Db ${I}) (local $o ${I}) (local $vs v128)`,
    code: `${set("Db", mul(get("D"), int(4)))}
    ${forLoop(
      "rows",
      "r",
      1,
      get("rows"),
      `${set("o", mul(get("r"), get("Db")))}
      ${set("vs", `(f32x4.splat (f32.load (${I}.add ${get("inv")} (${I}.shl ${get("r")} (${I}.const 2)))))`)}
      ${set("i", int(0))}
      ${forLoop(
        "cols",
        "i",
        16,
        get("Db"),
        `(v128.store ${add(get("dw"), get("i"))} ${madd(`(f32x4.mul (v128.load ${add(get("dy"), add(get("o"), get("i")))}) (v128.load ${add(get("x"), add(get("o"), get("i")))}))`, get("vs"), `(v128.load ${add(get("dw"), get("i"))})`)})`,
      )}`,
    )}`,
  };
}

/** out = silu(gate) · up over n elements (n a multiple of 4). */
export function swiglu({ I }: Wat): Body {
  return {
    locals: `(local $i ${I}) (local $nb ${I}) (local $g v128)`,
    code: `(local.set $nb (${I}.mul (local.get $n) (${I}.const 4)))
    (block $done (loop $l
      (br_if $done (${I}.ge_u (local.get $i) (local.get $nb)))
      (local.set $g (v128.load (${I}.add (local.get $gate) (local.get $i))))
      (v128.store (${I}.add (local.get $out) (local.get $i))
        (f32x4.mul (f32x4.div (local.get $g) (f32x4.add (v128.const f32x4 1 1 1 1) (call $exp (f32x4.neg (local.get $g)))))
          (v128.load (${I}.add (local.get $up) (local.get $i)))))
      (local.set $i (${I}.add (local.get $i) (${I}.const 16)))
      (br $l)))`,
  };
}

/** The attention kernels, forward and backward, which walk keys in groups of 4 then singly. */
export function attentionKernels(w: Wat): { forward: Body; backward: Body } {
  const { I, int, add, mul, forLoop, madd } = w;
  const attentionLocals = `(local $t ${I}) (local $h ${I}) (local $j ${I}) (local $i ${I}) (local $span ${I}) (local $hdb ${I})
    (local $kvb ${I}) (local $qb ${I}) (local $group ${I}) (local $kvh ${I}) (local $max f32) (local $sum f32) (local $s f32)
    (local $e v128) (local $ps ${I}) (local $d v128) (local $qv v128) (local $tv v128)
    ${range(4)
      .map(
        (r) => `(local $a${r} v128) (local $pv${r} v128) (local $kp${r} ${I}) (local $xp${r} ${I})`,
      )
      .join(" ")}`;
  /** Loops `j` over [0, span) in groups of R = 4 while they fit, then one at a time. */
  const keyGroups = (label: string, body: (R: number) => string) => `${set("j", int(0))}
        ${forLoop(`${label}4`, "j", 4, get("span"), body(4))}
        ${forLoop(`${label}1`, "j", 1, get("span"), body(1))}`;
  /** `$name_r` = base + (j + r)·kvb: row j + r of a [span, KV·hd] operand (at the head's column). */
  const rowPtrs = (R: number, name: string, base: string) =>
    range(R)
      .map((r) => set(`${name}${r}`, add(get(base), mul(add(get("j"), int(r)), get("kvb")))))
      .join("\n");
  const scoreAt = (r: number) =>
    add(get("scores"), `(${I}.shl ${add(get("j"), int(r))} (${I}.const 2))`);
  const vecLoop = (label: string, body: string) => `${set("i", int(0))}
          (block $${label}d (loop $${label}l
            (br_if $${label}d (${I}.ge_u ${get("i")} ${get("hdb")}))
            ${body}
            ${set("i", add(get("i"), int(16)))}
            (br $${label}l)))`;
  const at = (ptr: string) => `(${I}.add ${get(ptr)} ${get("i")})`;
  /** scores[j] = q·k_j·scale for R keys at once (R accumulators), tracking the maximum. */
  const scoreGroup = (R: number) => `${rowPtrs(R, "kp", "pk")}
          ${range(R)
            .map((r) => set(`a${r}`, "(v128.const i32x4 0 0 0 0)"))
            .join("\n")}
          ${vecLoop(
            `s${R}`,
            `${set("qv", `(v128.load ${at("pq")})`)}
            ${range(R)
              .map((r) =>
                set(`a${r}`, madd(get("qv"), `(v128.load ${at(`kp${r}`)})`, get(`a${r}`))),
              )
              .join("\n")}`,
          )}
          ${range(R)
            .map(
              (r) => `${set("s", `(f32.mul ${hsum(`a${r}`)} ${get("scale")})`)}
          (f32.store ${scoreAt(r)} ${get("s")})
          ${set("max", `(f32.max ${get("max")} ${get("s")})`)}`,
            )
            .join("\n")}`;
  /** Scores of row t against keys 0..span−1 for head h, then exponentials and their sum. */
  const scoresAndExps = `${set("max", "(f32.const -inf)")}
        ${keyGroups("sc", scoreGroup)}
        ;; exponentials (padded to a multiple of 4; the padding is excluded from the sum)
        ${set("sum", "(f32.const 0)")}
        ${set("j", int(0))}
        (block $ed (loop $el
          (br_if $ed (${I}.ge_u ${get("j")} ${get("span")}))
          ${set("ps", scoreAt(0))}
          ${set("e", `(call $exp (f32x4.sub (v128.load ${get("ps")}) (f32x4.splat ${get("max")})))`)}
          (v128.store ${get("ps")} ${get("e")})
          ${range(4)
            .map((lane) =>
              lane === 0
                ? set("sum", `(f32.add ${get("sum")} (f32x4.extract_lane 0 ${get("e")}))`)
                : `(if (${I}.lt_u ${add(get("j"), int(lane))} ${get("span")}) (then ${set("sum", `(f32.add ${get("sum")} (f32x4.extract_lane ${lane} ${get("e")}))`)}))`,
            )
            .join("\n")}
          ${set("j", add(get("j"), int(4)))}
          (br $el)))`;
  const attentionSetup = `${set("hdb", mul(get("hd"), int(4)))}
    ${set("kvb", mul(get("KV"), get("hdb")))}
    ${set("qb", mul(get("H"), get("hdb")))}
    ${set("group", `(${I}.div_u ${get("H")} ${get("KV")})`)}`;
  /** Pointer to row t, head h of a [n, H·hd] operand. */
  const headRow = (base: string) =>
    add(get(base), add(mul(get("t"), get("qb")), mul(get("h"), get("hdb"))));
  /** The strides, then `body` for each row t (against `span` keys) and head h. */
  const eachRowAndHead = (span: string, body: string) => `${attentionSetup}
    ${set("t", int(0))}
    ${forLoop(
      "tl",
      "t",
      1,
      get("n"),
      `${set("span", span)}
      ${set("h", int(0))}
      ${forLoop("hl", "h", 1, get("H"), body)}`,
    )}`;
  /**
   * Causal attention of n new rows (positions start..start+n−1) against keys/values
   * [span, kvDim]; q and out are [n, H·hd]. scores is scratch of at least start+n floats (+4).
   * Softmax is unnormalised during the weighted sum, then scaled by 1/Σ.
   */
  const forward: Body = {
    locals: `${attentionLocals} (local $pq ${I}) (local $pk ${I}) (local $po ${I})`,
    code: eachRowAndHead(
      add(add(get("start"), get("t")), int(1)),
      `${set("pq", headRow("q"))}
        ${set("kvh", mul(`(${I}.div_u ${get("h")} ${get("group")})`, get("hdb")))}
        ${set("pk", add(get("k"), get("kvh")))}
        ${scoresAndExps}
        ;; weighted sum of values, R at a time
        ${set("po", headRow("out"))}
        ${vecLoop("z", `(v128.store ${at("po")} (v128.const i32x4 0 0 0 0))`)}
        ${set("pk", add(get("v"), get("kvh")))}
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
              .map((r) => set("tv", madd(get(`pv${r}`), `(v128.load ${at(`kp${r}`)})`, get("tv"))))
              .join("\n")}
            (v128.store ${at("po")} ${get("tv")})`,
          )}`,
        )}
        ${set("pv0", `(f32x4.splat (f32.div (f32.const 1) ${get("sum")}))`)}
        ${vecLoop("nz", `(v128.store ${at("po")} (f32x4.mul (v128.load ${at("po")}) ${get("pv0")}))`)}`,
    ),
  };
  /**
   * Backward of causal self-attention over one sequence of n rows (positions 0..n−1),
   * recomputing the probabilities instead of storing them. Adds into dq [n, H·hd] and dk, dv
   * [n, KV·hd].
   */
  const backward: Body = {
    locals: `${attentionLocals} (local $pq ${I}) (local $pk ${I}) (local $pv ${I}) (local $pdo ${I}) (local $pdq ${I}) (local $pdk ${I}) (local $pdv ${I})
    (local $dot f32) (local $inv f32) (local $p f32) (local $dp f32)`,
    code: eachRowAndHead(
      add(get("t"), int(1)),
      `${set("pq", headRow("q"))}
        ${set("pdo", headRow("dout"))}
        ${set("pdq", headRow("dq"))}
        ${set("kvh", mul(`(${I}.div_u ${get("h")} ${get("group")})`, get("hdb")))}
        ${set("pk", add(get("k"), get("kvh")))}
        ${set("pv", add(get("v"), get("kvh")))}
        ${set("pdk", add(get("dk"), get("kvh")))}
        ${set("pdv", add(get("dv"), get("kvh")))}
        ${scoresAndExps}
        ${set("inv", `(f32.div (f32.const 1) ${get("sum")})`)}
        ;; dP_j = dout·v_j; dv_j += p_j·dout; dot = Σ p_j dP_j
        ${set("dot", "(f32.const 0)")}
        ${keyGroups(
          "dv",
          (R) => `${rowPtrs(R, "kp", "pv")}
          ${rowPtrs(R, "xp", "pdv")}
          ${range(R)
            .map(
              (r) => `${set("p", `(f32.mul (f32.load ${scoreAt(r)}) ${get("inv")})`)}
          (f32.store ${scoreAt(r)} ${get("p")})
          ${set(`pv${r}`, `(f32x4.splat ${get("p")})`)}
          ${set(`a${r}`, "(v128.const i32x4 0 0 0 0)")}`,
            )
            .join("\n")}
          ${vecLoop(
            `g${R}`,
            `${set("d", `(v128.load ${at("pdo")})`)}
            ${range(R)
              .map(
                (r) => `${set(`a${r}`, madd(get("d"), `(v128.load ${at(`kp${r}`)})`, get(`a${r}`)))}
            (v128.store ${at(`xp${r}`)} ${madd(get(`pv${r}`), get("d"), `(v128.load ${at(`xp${r}`)})`)})`,
              )
              .join("\n")}`,
          )}
          ${range(R)
            .map(
              (r) => `${set("dp", hsum(`a${r}`))}
          (f32.store ${add(get("dps"), `(${I}.shl ${add(get("j"), int(r))} (${I}.const 2))`)} ${get("dp")})
          ${set("dot", `(f32.add ${get("dot")} (f32.mul (f32x4.extract_lane 0 ${get(`pv${r}`)}) ${get("dp")}))`)}`,
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
                `(f32x4.splat (f32.mul (f32.mul (f32.load ${scoreAt(r)}) (f32.sub (f32.load ${add(get("dps"), `(${I}.shl ${add(get("j"), int(r))} (${I}.const 2))`)}) ${get("dot")})) ${get("scale")}))`,
              ),
            )
            .join("\n")}
          ${vecLoop(
            `k${R}`,
            `${set("qv", `(v128.load ${at("pq")})`)}
            ${set("tv", `(v128.load ${at("pdq")})`)}
            ${range(R)
              .map(
                (r) => `${set("tv", madd(get(`pv${r}`), `(v128.load ${at(`kp${r}`)})`, get("tv")))}
            (v128.store ${at(`xp${r}`)} ${madd(get(`pv${r}`), get("qv"), `(v128.load ${at(`xp${r}`)})`)})`,
              )
              .join("\n")}
            (v128.store ${at("pdq")} ${get("tv")})`,
          )}`,
        )}`,
    ),
  };
  return { forward, backward };
}

/** dGate, dUp of out = silu(gate)·up given dOut (n a multiple of 4). */
export function swigluBackward({ I }: Wat): Body {
  return {
    locals: `(local $i ${I}) (local $nb ${I}) (local $g v128) (local $s v128) (local $d v128)`,
    code: `(local.set $nb (${I}.mul (local.get $n) (${I}.const 4)))
    (block $done (loop $l
      (br_if $done (${I}.ge_u (local.get $i) (local.get $nb)))
      (local.set $g (v128.load (${I}.add (local.get $gate) (local.get $i))))
      (local.set $d (v128.load (${I}.add (local.get $dout) (local.get $i))))
      (local.set $s (f32x4.div (v128.const f32x4 1 1 1 1) (f32x4.add (v128.const f32x4 1 1 1 1) (call $exp (f32x4.neg (local.get $g))))))
      (v128.store (${I}.add (local.get $dup) (local.get $i)) (f32x4.mul (local.get $d) (f32x4.mul (local.get $g) (local.get $s))))
      (v128.store (${I}.add (local.get $dgate) (local.get $i))
        (f32x4.mul (f32x4.mul (local.get $d) (v128.load (${I}.add (local.get $up) (local.get $i))))
          (f32x4.mul (local.get $s) (f32x4.add (v128.const f32x4 1 1 1 1) (f32x4.mul (local.get $g) (f32x4.sub (v128.const f32x4 1 1 1 1) (local.get $s)))))))
      (local.set $i (${I}.add (local.get $i) (${I}.const 16)))
      (br $l)))`,
  };
}

/** Row-wise x ← softmax(x)·scale[r]; writes each row's max and Σexp (cols a multiple of 4). */
export function softmaxRows({ I }: Wat): Body {
  return {
    locals: `(local $r ${I}) (local $i ${I}) (local $cb ${I}) (local $px ${I}) (local $m v128) (local $e v128) (local $acc v128) (local $max f32) (local $f v128)`,
    code: `(local.set $cb (${I}.mul (local.get $cols) (${I}.const 4)))
    (block $done (loop $rl
      (br_if $done (${I}.ge_u (local.get $r) (local.get $rows)))
      (local.set $px (${I}.add (local.get $x) (${I}.mul (local.get $r) (local.get $cb))))
      (local.set $m (v128.const f32x4 -inf -inf -inf -inf))
      (local.set $i (${I}.const 0))
      (block $d1 (loop $l1
        (br_if $d1 (${I}.ge_u (local.get $i) (local.get $cb)))
        (local.set $m (f32x4.max (local.get $m) (v128.load (${I}.add (local.get $px) (local.get $i)))))
        (local.set $i (${I}.add (local.get $i) (${I}.const 16)))
        (br $l1)))
      (local.set $max (f32.max (f32.max (f32x4.extract_lane 0 (local.get $m)) (f32x4.extract_lane 1 (local.get $m)))
        (f32.max (f32x4.extract_lane 2 (local.get $m)) (f32x4.extract_lane 3 (local.get $m)))))
      (local.set $m (f32x4.splat (local.get $max)))
      (local.set $acc (v128.const i32x4 0 0 0 0))
      (local.set $i (${I}.const 0))
      (block $d2 (loop $l2
        (br_if $d2 (${I}.ge_u (local.get $i) (local.get $cb)))
        (local.set $e (call $exp (f32x4.sub (v128.load (${I}.add (local.get $px) (local.get $i))) (local.get $m))))
        (v128.store (${I}.add (local.get $px) (local.get $i)) (local.get $e))
        (local.set $acc (f32x4.add (local.get $acc) (local.get $e)))
        (local.set $i (${I}.add (local.get $i) (${I}.const 16)))
        (br $l2)))
      (f32.store (${I}.add (local.get $rmax) (${I}.shl (local.get $r) (${I}.const 2))) (local.get $max))
      (f32.store (${I}.add (local.get $rsum) (${I}.shl (local.get $r) (${I}.const 2))) ${hsum("acc")})
      (local.set $f (f32x4.splat (f32.div (f32.load (${I}.add (local.get $scale) (${I}.shl (local.get $r) (${I}.const 2)))) ${hsum("acc")})))
      (local.set $i (${I}.const 0))
      (block $d3 (loop $l3
        (br_if $d3 (${I}.ge_u (local.get $i) (local.get $cb)))
        (v128.store (${I}.add (local.get $px) (local.get $i)) (f32x4.mul (v128.load (${I}.add (local.get $px) (local.get $i))) (local.get $f)))
        (local.set $i (${I}.add (local.get $i) (${I}.const 16)))
        (br $l3)))
      (local.set $r (${I}.add (local.get $r) (${I}.const 1)))
      (br $rl)))`,
  };
}
