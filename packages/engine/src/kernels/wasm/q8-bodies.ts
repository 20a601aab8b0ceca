/**
 * The bodies of the int8 (q8) kernels, in WebAssembly text: the layout and arithmetic are those
 * of `../q8.ts` (its JS reference computes the same integers). Only the build runs them.
 */
import { type Body, get, laneShift, range, set, type Wat } from "./wat.ts";

const ONES = "(v128.const i8x16 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1)";
const HIGH_HALVES = "(v128.const i32x4 0xffff0000 0xffff0000 0xffff0000 0xffff0000)";

/** i8x16.shuffle of two vectors' 32-bit lanes (0–3 the first's, 4–7 the second's). */
const lanes32 = (a: string, b: string, picks: number[]) =>
  `(i8x16.shuffle ${picks.flatMap((l) => [4 * l, 4 * l + 1, 4 * l + 2, 4 * l + 3]).join(" ")} ${a} ${b})`;

/** The most rows and quads a tile computes. */
const MAX_ROWS = 4;
const MAX_QUADS = 4;

/**
 * out[M,N] (+)= A·Wᵀ on a q8 weight (quads from `p`, K/32 blocks of 144 bytes each; N a
 * multiple of 4) and activations quantized by `quantize_q8` (`a`: M rows of 2K bytes; `sa`: M
 * rows of K/32 F32 scales). Per block of 32 k, each output's integer sum Σ q·u − 127·Σq (from
 * the header) is exact; then out += sum·(d·s) in F32, block after block in order,
 * whatever the tile: a row gives the same bits alone or in a batch, on any thread.
 * Tiles: 4 rows × 1 quad for the bulk; the last 1–3 rows take 4, 2 or 1 quads at a time (so
 * decoding keeps several accumulators in flight).
 * Activations come as two halves per block (`quantize_q8`): 32 bytes of h, the high 7 bits of
 * u = q + 127, then 32 of l, its low bit. Relaxed SIMD: `i32x4.relaxed_dot_i8x16_i7x16_add_s`
 * sums the 4 products of each 32-bit lane (one row's 4 consecutive k) into it, for h and for l
 * (2·Σq·h + Σq·l). Plain SIMD: u is rebuilt in 16 bits, and `i32x4.dot_i16x8_s` sums pairs into
 * two accumulators, combined once per block.
 */
export function gemmQ8(w: Wat): Body {
  const { I, int, add, mul, forLoop, madd, relaxed } = w;
  const zero = "(v128.const i32x4 0 0 0 0)";
  const A = (i: number, j: number) => `a${i}_${j}`;
  const B = (i: number, j: number) => `b${i}_${j}`;
  const F = (i: number, j: number) => `f${i}_${j}`;
  /** Relaxed: the sums over l (from −127·Σq); plain: the second pairs' accumulator. */
  const rowOut = (i: number) =>
    set("po", add(get("out"), add(mul(add(get("m"), int(i)), get("ldo")), mul(get("n"), int(4)))));
  const tile = (MR: number, NQ: number): string => {
    const label = `${MR}_${NQ}`;
    const each = (f: (i: number, j: number) => string) =>
      range(MR)
        .flatMap((i) => range(NQ).map((j) => f(i, j)))
        .join("\n");
    const init = range(MR)
      .map(
        (i) => `${rowOut(i)}
        ${range(NQ)
          .map((j) =>
            set(
              F(i, j),
              `(select (v128.load offset=${j * 16} ${get("po")}) ${zero} (${I}.ne ${get("acc")} (${I}.const 0)))`,
            ),
          )
          .join("\n")}`,
      )
      .join("\n");
    const pointers = [
      ...range(MR).map((i) =>
        set(`pa${i}`, add(get("a"), mul(add(get("m"), int(i)), mul(get("K"), int(2))))),
      ),
      ...range(MR).map((i) =>
        set(`ps${i}`, add(get("sa"), mul(add(get("m"), int(i)), mul(get("nb"), int(4))))),
      ),
      ...range(NQ).map((j) =>
        set(
          `pb${j}`,
          add(get("p"), mul(add(`(${I}.shr_u ${get("n")} (${I}.const 2))`, int(j)), get("qs"))),
        ),
      ),
      // Decode tiles touch the next tile's quads as they stream theirs (each quad is a short
      // run, which alone leaves memory latency-bound); the last tile touches its own.
      ...(NQ > 1
        ? range(NQ).map((j) =>
            set(
              `pt${j}`,
              `(select ${add(get(`pb${j}`), mul(int(NQ), get("qs")))} ${get(`pb${j}`)} (${I}.le_u ${add(get("n"), int(8 * NQ))} ${get("N")}))`,
            ),
          )
        : []),
    ].join("\n");
    // The header: scales (high halves) and −Σq (low halves, sign-extended, times 127).
    const headers = range(NQ)
      .map(
        (j) => `${set("h", `(v128.load ${get(`pb${j}`)})`)}
        ${set(`d${j}`, `(v128.and ${get("h")} ${HIGH_HALVES})`)}
        ${set(`c${j}`, `(i32x4.mul (i32x4.shr_s (i32x4.shl ${get("h")} ${laneShift(16)}) ${laneShift(16)}) (v128.const i32x4 127 127 127 127))`)}`,
      )
      .join("\n");
    const start = relaxed
      ? each((i, j) => `${set(A(i, j), zero)} ${set(B(i, j), get(`c${j}`))}`)
      : each((i, j) => `${set(A(i, j), zero)} ${set(B(i, j), zero)}`);
    /** 4 bytes of row i's h (low: its l), k = 4g…4g+3, in every lane. */
    const splat = (i: number, g: number, low = false) =>
      `(v128.load32_splat offset=${g * 4 + (low ? 32 : 0)} ${get(`pa${i}`)})`;
    const group = (g: number): string => {
      const lines: string[] = [];
      const xh = (i: number) => (NQ === 1 && relaxed ? splat(i, g) : get(`x${i}`));
      const xl = (i: number) => (NQ === 1 && relaxed ? splat(i, g, true) : get(`y${i}`));
      if (NQ > 1 && relaxed)
        for (let i = 0; i < MR; i++) {
          lines.push(set(`x${i}`, splat(i, g)));
          lines.push(set(`y${i}`, splat(i, g, true)));
        }
      if (!relaxed)
        for (let i = 0; i < MR; i++)
          lines.push(
            set(
              `x${i}`,
              `(i16x8.add (i16x8.shl (i16x8.extend_low_i8x16_u ${splat(i, g)}) ${laneShift(1)}) (i16x8.extend_low_i8x16_u ${splat(i, g, true)}))`,
            ),
          );
      for (let j = 0; j < NQ; j++) {
        const wv = `(v128.load offset=${16 + g * 16} ${get(`pb${j}`)})`;
        if (relaxed) {
          lines.push(set("w", wv));
          for (let i = 0; i < MR; i++) {
            lines.push(
              set(
                A(i, j),
                `(i32x4.relaxed_dot_i8x16_i7x16_add_s ${get("w")} ${xh(i)} ${get(A(i, j))})`,
              ),
            );
            lines.push(
              set(
                B(i, j),
                `(i32x4.relaxed_dot_i8x16_i7x16_add_s ${get("w")} ${xl(i)} ${get(B(i, j))})`,
              ),
            );
          }
        } else {
          lines.push(set("w", wv));
          lines.push(set("wl", `(i16x8.extend_low_i8x16_s ${get("w")})`));
          lines.push(set("w", `(i16x8.extend_high_i8x16_s ${get("w")})`));
          for (let i = 0; i < MR; i++) {
            lines.push(
              set(
                A(i, j),
                `(i32x4.add ${get(A(i, j))} (i32x4.dot_i16x8_s ${get("wl")} ${get(`x${i}`)}))`,
              ),
            );
            lines.push(
              set(
                B(i, j),
                `(i32x4.add ${get(B(i, j))} (i32x4.dot_i16x8_s ${get("w")} ${get(`x${i}`)}))`,
              ),
            );
          }
        }
      }
      return lines.join("\n");
    };
    // Plain SIMD: lanes of A are row 0's and row 1's pairs of k, of B rows 2's and 3's.
    const combine = relaxed
      ? each((i, j) =>
          set(A(i, j), `(i32x4.add (i32x4.shl ${get(A(i, j))} ${laneShift(1)}) ${get(B(i, j))})`),
        )
      : each((i, j) =>
          set(
            A(i, j),
            `(i32x4.add (i32x4.add ${lanes32(get(A(i, j)), get(B(i, j)), [0, 2, 4, 6])} ${lanes32(get(A(i, j)), get(B(i, j)), [1, 3, 5, 7])}) ${get(`c${j}`)})`,
          ),
        );
    const scale = range(MR)
      .map(
        (i) => `${set("s", `(v128.load32_splat ${get(`ps${i}`)})`)}
        ${range(NQ)
          .map((j) =>
            set(
              F(i, j),
              madd(
                `(f32x4.convert_i32x4_s ${get(A(i, j))})`,
                `(f32x4.mul ${get(`d${j}`)} ${get("s")})`,
                get(F(i, j)),
              ),
            ),
          )
          .join("\n")}`,
      )
      .join("\n");
    const touches =
      NQ > 1
        ? range(NQ)
            .flatMap((j) =>
              [0, 64, 128].map((o) => `(drop (${I}.load offset=${o} ${get(`pt${j}`)}))`),
            )
            .join("\n")
        : "";
    const advance = [
      ...(NQ > 1 ? range(NQ).map((j) => set(`pt${j}`, add(get(`pt${j}`), int(144)))) : []),
      ...range(MR).map((i) => set(`pa${i}`, add(get(`pa${i}`), int(64)))),
      ...range(MR).map((i) => set(`ps${i}`, add(get(`ps${i}`), int(4)))),
      ...range(NQ).map((j) => set(`pb${j}`, add(get(`pb${j}`), int(144)))),
    ].join("\n");
    const store = range(MR)
      .map(
        (i) => `${rowOut(i)}
        ${range(NQ)
          .map((j) => `(v128.store offset=${j * 16} ${get("po")} ${get(F(i, j))})`)
          .join("\n")}`,
      )
      .join("\n");
    return `${init}
      ${pointers}
      ${set("b", int(0))}
      ${forLoop(
        `qb${label}`,
        "b",
        1,
        get("nb"),
        `${touches}
        ${headers}
        ${start}
        ${range(8).map(group).join("\n")}
        ${combine}
        ${scale}
        ${advance}`,
      )}
      ${store}`;
  };
  const panels = (MR: number, NQ: number) => `${set("n", int(0))}
      ${NQ > 1 ? forLoop(`qw${MR}`, "n", NQ * 4, get("N"), tile(MR, NQ)) : ""}
      ${forLoop(`qn${MR}`, "n", 4, get("N"), tile(MR, 1))}`;
  const quadsFor: Record<number, number> = { 1: 4, 2: 2, 3: 1 };
  const locals = [
    ...["m", "n", "b", "nb", "qs", "po"]
      .concat(
        range(MAX_ROWS).flatMap((i) => [`pa${i}`, `ps${i}`]),
        range(MAX_QUADS).flatMap((j) => [`pb${j}`, `pt${j}`]),
      )
      .map((l) => `(local $${l} ${I})`),
    ...["w", "wl", "h", "s"].map((l) => `(local $${l} v128)`),
    ...range(MAX_ROWS).flatMap((i) => [`(local $x${i} v128)`, `(local $y${i} v128)`]),
    ...range(MAX_QUADS).flatMap((j) => [`(local $d${j} v128)`, `(local $c${j} v128)`]),
    ...range(MAX_ROWS).flatMap((i) =>
      range(MAX_QUADS).flatMap((j) => [A(i, j), B(i, j), F(i, j)].map((l) => `(local $${l} v128)`)),
    ),
  ];
  return {
    locals: locals.join(" "),
    code: `${set("nb", `(${I}.shr_u ${get("K")} (${I}.const 5))`)}
    ${set("qs", mul(get("nb"), int(144)))}
    ${set("m", int(0))}
    ${forLoop("qm", "m", MAX_ROWS, get("M"), panels(MAX_ROWS, 1))}
    ${[3, 2, 1]
      .map(
        (r) =>
          `(if (${I}.eq (${I}.sub ${get("M")} ${get("m")}) ${int(r)}) (then ${panels(r, quadsFor[r]!)}))`,
      )
      .join("\n")}`,
  };
}

/**
 * Quantizes `rows` rows of K activations (K a multiple of 32; source rows `lda` bytes apart) as
 * `quantizeActivations` (`../q8.ts`) does: per block of 32, s = max|x| / 127 into `sa` (rows of
 * K/32 floats), u = nearest(x · (127 / max|x|)) + 127, stored into `dst` (rows of 2K bytes) as
 * 32 bytes of h = u >> 1, then 32 of l = u & 1.
 */
export function quantizeQ8(w: Wat): Body {
  const { I, int, add, mul, forLoop } = w;
  const v = (i: number) => get(`v${i}`);
  const q = (i: number) =>
    `(i32x4.add (i32x4.trunc_sat_f32x4_s (f32x4.nearest (f32x4.mul ${v(i)} ${get("iv")}))) (v128.const i32x4 127 127 127 127))`;
  const block = `${range(8)
    .map((i) => set(`v${i}`, `(v128.load offset=${i * 16} ${get("px")})`))
    .join("\n")}
    ${set("mx", `(f32x4.abs ${v(0)})`)}
    ${range(7)
      .map((i) => set("mx", `(f32x4.max ${get("mx")} (f32x4.abs ${v(i + 1)}))`))
      .join("\n")}
    ${set("mx", `(f32x4.max ${get("mx")} ${lanes32(get("mx"), get("mx"), [2, 3, 0, 1])})`)}
    ${set("mx", `(f32x4.max ${get("mx")} ${lanes32(get("mx"), get("mx"), [1, 0, 3, 2])})`)}
    ${set("amax", `(f32x4.extract_lane 0 ${get("mx")})`)}
    (f32.store ${get("pq")} (f32.div ${get("amax")} (f32.const 127)))
    ${set("iv", `(f32x4.splat (select (f32.div (f32.const 127) ${get("amax")}) (f32.const 0) (f32.gt ${get("amax")} (f32.const 0))))`)}
    ${set("u0", `(i8x16.narrow_i16x8_u (i16x8.narrow_i32x4_s ${q(0)} ${q(1)}) (i16x8.narrow_i32x4_s ${q(2)} ${q(3)}))`)}
    ${set("u1", `(i8x16.narrow_i16x8_u (i16x8.narrow_i32x4_s ${q(4)} ${q(5)}) (i16x8.narrow_i32x4_s ${q(6)} ${q(7)}))`)}
    (v128.store ${get("pd")} (i8x16.shr_u ${get("u0")} ${laneShift(1)}))
    (v128.store offset=16 ${get("pd")} (i8x16.shr_u ${get("u1")} ${laneShift(1)}))
    (v128.store offset=32 ${get("pd")} (v128.and ${get("u0")} ${ONES}))
    (v128.store offset=48 ${get("pd")} (v128.and ${get("u1")} ${ONES}))
    ${set("px", add(get("px"), int(128)))}
    ${set("pd", add(get("pd"), int(64)))}
    ${set("pq", add(get("pq"), int(4)))}`;
  return {
    locals: `(local $r ${I}) (local $b ${I}) (local $nb ${I}) (local $px ${I}) (local $pd ${I}) (local $pq ${I})
    (local $amax f32) (local $mx v128) (local $iv v128) (local $u0 v128) (local $u1 v128) ${range(8)
      .map((i) => `(local $v${i} v128)`)
      .join(" ")}`,
    code: `${set("nb", `(${I}.shr_u ${get("K")} (${I}.const 5))`)}
    ${set("r", int(0))}
    ${forLoop(
      "qr",
      "r",
      1,
      get("rows"),
      `${set("px", add(get("src"), mul(get("r"), get("lda"))))}
      ${set("pd", add(get("dst"), mul(get("r"), mul(get("K"), int(2)))))}
      ${set("pq", add(get("sa"), mul(get("r"), mul(get("nb"), int(4)))))}
      ${set("b", int(0))}
      ${forLoop("qk", "b", 1, get("nb"), block)}`,
    )}`,
  };
}

/**
 * B-panels (F32, for dX = dY·W in a backward) of `quads` quads of a q8 weight from `src` (K/32 =
 * `nb` blocks each), dequantized (d·q): weight row 4j + c, columns 8p…8p+7 go to
 * dst + (p·N + 4j + c)·32, N being the rows of the B-panels (the weight rows of this slab).
 */
export function q8ToB(w: Wat): Body {
  const { I, int, add, mul, forLoop } = w;
  const body = `${set("at", add(get("src"), mul(add(mul(get("j"), get("nb")), get("b")), int(144))))}
    ${set("h", `(v128.and (v128.load ${get("at")}) ${HIGH_HALVES})`)}
    ${range(4)
      .map((c) => set(`sc${c}`, lanes32(get("h"), get("h"), [c, c, c, c])))
      .join("\n")}
    ${range(4)
      .map(
        (t) => `${set("v0", `(v128.load offset=${16 + 32 * t} ${get("at")})`)}
      ${set("v1", `(v128.load offset=${32 + 32 * t} ${get("at")})`)}
      ${set(
        "pd",
        add(
          get("dst"),
          mul(
            int(32),
            add(mul(add(mul(get("b"), int(4)), int(t)), get("N")), mul(get("j"), int(4))),
          ),
        ),
      )}
      ${range(4)
        .map(
          (c) => `${set(
            "e",
            `(i16x8.extend_low_i8x16_s (i8x16.shuffle ${[0, 1, 2, 3].map((k) => 4 * c + k).join(" ")} ${[0, 1, 2, 3].map((k) => 16 + 4 * c + k).join(" ")} 0 0 0 0 0 0 0 0 ${get("v0")} ${get("v1")}))`,
          )}
        (v128.store offset=${c * 32} ${get("pd")} (f32x4.mul (f32x4.convert_i32x4_s (i32x4.extend_low_i16x8_s ${get("e")})) ${get(`sc${c}`)}))
        (v128.store offset=${c * 32 + 16} ${get("pd")} (f32x4.mul (f32x4.convert_i32x4_s (i32x4.extend_high_i16x8_s ${get("e")})) ${get(`sc${c}`)}))`,
        )
        .join("\n")}`,
      )
      .join("\n")}`;
  return {
    locals: `(local $j ${I}) (local $b ${I}) (local $at ${I}) (local $pd ${I}) (local $h v128) (local $e v128)
    (local $v0 v128) (local $v1 v128) ${range(4)
      .map((c) => `(local $sc${c} v128)`)
      .join(" ")}`,
    code: `${set("j", int(0))}
    ${forLoop(
      "qj",
      "j",
      1,
      get("quads"),
      `${set("b", int(0))}
      ${forLoop("qbb", "b", 1, get("nb"), body)}`,
    )}`,
  };
}
