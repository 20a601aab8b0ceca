/**
 * The bodies of the int8 (q8) kernels, in WebAssembly text: the layout and arithmetic are those
 * of `../q8.ts` (its JS reference computes the same integers). Only the build runs them.
 */
import { type Body, get, range, set, type Wat } from "./wat.ts";

const HIGH_HALVES = "(v128.const i32x4 0xffff0000 0xffff0000 0xffff0000 0xffff0000)";

/** i8x16.shuffle of two vectors' 32-bit lanes (0–3 the first's, 4–7 the second's). */
const lanes32 = (a: string, b: string, picks: number[]) =>
  `(i8x16.shuffle ${picks.flatMap((l) => [4 * l, 4 * l + 1, 4 * l + 2, 4 * l + 3]).join(" ")} ${a} ${b})`;

/** The most rows a tile computes. */
const MAX_ROWS = 4;

/**
 * out[M,N] (+)= A·Wᵀ on a q8 weight (quads from `p`, K/32 blocks of 144 bytes each; N a
 * multiple of 4) and activations quantized by `quantize_q8` (`a`: M rows of K signed bytes q;
 * `sa`: M rows of K/32 F32 scales). Per block of 32 k, each output's integer sum Σ w·q is
 * exact; then out += sum·(d·s) in F32, block after block in order, whatever the tile: a row
 * gives the same bits alone or in a batch, on any thread.
 * Tiles are 4 rows (the last 1–3 rows: 1–3) × 1 quad, quad after quad: the weight is read
 * front to back as one stream, which memory prefetches best (decoding is bound by it; tiles
 * of 4 quads read as 4 short runs at a time streamed 0.6× as fast, measured).
 * Relaxed SIMD: `i32x4.relaxed_dot_i8x16_i7x16_add_s` sums the 4 products of each 32-bit lane
 * (one weight row's 4 consecutive k) into it, its second operand being 7-bit: the sign moves
 * onto the activation (as llama.cpp's x86 Q8_0 dot does), w·q = |w|·(±q), with |w| ≤ 127 and
 * |q| ≤ 127, so one dot product per 16 weights and row is exact on every implementation.
 * |w| and w's sign are taken once per group, and each row's q flipped by it, (q ^ m) − m.
 * With fewer than 4 rows, even and odd groups go to two accumulators (shorter chains).
 * Plain SIMD: both widened to 16 bits, `i32x4.dot_i16x8_s` sums pairs into two accumulators,
 * combined once per block.
 */
export function gemmQ8(w: Wat): Body {
  const { I, int, add, mul, forLoop, madd, relaxed } = w;
  const zero = "(v128.const i32x4 0 0 0 0)";
  const A = (i: number) => `a${i}`;
  const B = (i: number) => `b${i}`;
  const F = (i: number) => `f${i}`;
  const rowOut = (i: number) =>
    set("po", add(get("out"), add(mul(add(get("m"), int(i)), get("ldo")), mul(get("n"), int(4)))));
  const tile = (MR: number): string => {
    const each = (f: (i: number) => string) => range(MR).map(f).join("\n");
    const init = each(
      (i) => `${rowOut(i)}
        ${set(F(i), `(select (v128.load ${get("po")}) ${zero} (${I}.ne ${get("acc")} (${I}.const 0)))`)}`,
    );
    const pointers = [
      ...range(MR).map((i) => set(`pa${i}`, add(get("a"), mul(add(get("m"), int(i)), get("K"))))),
      ...range(MR).map((i) =>
        set(`ps${i}`, add(get("sa"), mul(add(get("m"), int(i)), mul(get("nb"), int(4))))),
      ),
      set("pb", add(get("p"), mul(`(${I}.shr_u ${get("n")} (${I}.const 2))`, get("qs")))),
    ].join("\n");
    const twoAcc = !relaxed || MR < 4;
    const start = each((i) => (twoAcc ? `${set(A(i), zero)} ${set(B(i), zero)}` : set(A(i), zero)));
    /** Row i's q at k = 4g…4g+3, in every 32-bit lane. */
    const splat = (i: number, g: number) => `(v128.load32_splat offset=${g * 4} ${get(`pa${i}`)})`;
    const group = (g: number): string => {
      const lines: string[] = [set("w", `(v128.load offset=${16 + g * 16} ${get("pb")})`)];
      if (relaxed) {
        lines.push(set("ws", `(i8x16.lt_s ${get("w")} ${zero})`));
        lines.push(set("w", `(i8x16.abs ${get("w")})`));
        const acc = (i: number) => (twoAcc && g % 2 === 1 ? B(i) : A(i));
        for (let i = 0; i < MR; i++)
          lines.push(
            set(
              acc(i),
              `(i32x4.relaxed_dot_i8x16_i7x16_add_s (i8x16.sub (v128.xor ${splat(i, g)} ${get("ws")}) ${get("ws")}) ${get("w")} ${get(acc(i))})`,
            ),
          );
      } else {
        lines.push(set("ws", `(i16x8.extend_low_i8x16_s ${get("w")})`));
        lines.push(set("w", `(i16x8.extend_high_i8x16_s ${get("w")})`));
        for (let i = 0; i < MR; i++) {
          lines.push(set("x", `(i16x8.extend_low_i8x16_s ${splat(i, g)})`));
          lines.push(
            set(A(i), `(i32x4.add ${get(A(i))} (i32x4.dot_i16x8_s ${get("ws")} ${get("x")}))`),
          );
          lines.push(
            set(B(i), `(i32x4.add ${get(B(i))} (i32x4.dot_i16x8_s ${get("w")} ${get("x")}))`),
          );
        }
      }
      return lines.join("\n");
    };
    // Plain SIMD: lanes of A are row 0's and row 1's pairs of k, of B rows 2's and 3's.
    const combine = relaxed
      ? twoAcc
        ? each((i) => set(A(i), `(i32x4.add ${get(A(i))} ${get(B(i))})`))
        : ""
      : each((i) =>
          set(
            A(i),
            `(i32x4.add ${lanes32(get(A(i)), get(B(i)), [0, 2, 4, 6])} ${lanes32(get(A(i)), get(B(i)), [1, 3, 5, 7])})`,
          ),
        );
    // The header: each row's scale d (the high halves of its lanes).
    const scale = `${set("d", `(v128.and (v128.load ${get("pb")}) ${HIGH_HALVES})`)}
      ${each(
        (i) =>
          `${set(F(i), madd(`(f32x4.convert_i32x4_s ${get(A(i))})`, `(f32x4.mul ${get("d")} (v128.load32_splat ${get(`ps${i}`)}))`, get(F(i))))}`,
      )}`;
    const advance = [
      ...range(MR).map((i) => set(`pa${i}`, add(get(`pa${i}`), int(32)))),
      ...range(MR).map((i) => set(`ps${i}`, add(get(`ps${i}`), int(4)))),
      set("pb", add(get("pb"), int(144))),
    ].join("\n");
    const store = each((i) => `${rowOut(i)} (v128.store ${get("po")} ${get(F(i))})`);
    return `${init}
      ${pointers}
      ${set("b", int(0))}
      ${forLoop(
        `qb${MR}`,
        "b",
        1,
        get("nb"),
        `${start}
        ${range(8).map(group).join("\n")}
        ${combine}
        ${scale}
        ${advance}`,
      )}
      ${store}`;
  };
  const panels = (MR: number) => `${set("n", int(0))}
      ${forLoop(`qn${MR}`, "n", 4, get("N"), tile(MR))}`;
  const locals = [
    ...["m", "n", "b", "nb", "qs", "po", "pb"]
      .concat(range(MAX_ROWS).flatMap((i) => [`pa${i}`, `ps${i}`]))
      .map((l) => `(local $${l} ${I})`),
    ...["w", "ws", "x", "d"].map((l) => `(local $${l} v128)`),
    ...range(MAX_ROWS).flatMap((i) => [A(i), B(i), F(i)].map((l) => `(local $${l} v128)`)),
  ];
  return {
    locals: locals.join(" "),
    code: `${set("nb", `(${I}.shr_u ${get("K")} (${I}.const 5))`)}
    ${set("qs", mul(get("nb"), int(144)))}
    ${set("m", int(0))}
    ${forLoop("qm", "m", MAX_ROWS, get("M"), panels(MAX_ROWS))}
    ${[3, 2, 1]
      .map((r) => `(if (${I}.eq (${I}.sub ${get("M")} ${get("m")}) ${int(r)}) (then ${panels(r)}))`)
      .join("\n")}`,
  };
}

/**
 * Quantizes `rows` rows of K activations (K a multiple of 32; source rows `lda` bytes apart) as
 * `quantizeActivations` (`../q8.ts`) does: per block of 32, s = max|x| / 127 into `sa` (rows of
 * K/32 floats), q = nearest(x · (127 / max|x|)) in [−127, 127], stored into `dst` (rows of K
 * signed bytes).
 */
export function quantizeQ8(w: Wat): Body {
  const { I, int, add, mul, forLoop } = w;
  const v = (i: number) => get(`v${i}`);
  const q = (i: number) =>
    `(i32x4.trunc_sat_f32x4_s (f32x4.nearest (f32x4.mul ${v(i)} ${get("iv")})))`;
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
    (v128.store ${get("pd")} (i8x16.narrow_i16x8_s (i16x8.narrow_i32x4_s ${q(0)} ${q(1)}) (i16x8.narrow_i32x4_s ${q(2)} ${q(3)})))
    (v128.store offset=16 ${get("pd")} (i8x16.narrow_i16x8_s (i16x8.narrow_i32x4_s ${q(4)} ${q(5)}) (i16x8.narrow_i32x4_s ${q(6)} ${q(7)})))
    ${set("px", add(get("px"), int(128)))}
    ${set("pd", add(get("pd"), int(32)))}
    ${set("pq", add(get("pq"), int(4)))}`;
  return {
    locals: `(local $r ${I}) (local $b ${I}) (local $nb ${I}) (local $px ${I}) (local $pd ${I}) (local $pq ${I})
    (local $amax f32) (local $mx v128) (local $iv v128) ${range(8)
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
      ${set("pd", add(get("dst"), mul(get("r"), get("K"))))}
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
