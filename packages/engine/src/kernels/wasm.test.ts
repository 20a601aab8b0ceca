import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import { assemble } from "../../scripts/build-wasm.ts";
import { Rng } from "../model/rng.ts";
import { jsKernels } from "./js.ts";
import { createWasmKernels, relaxedSimdSupported } from "./wasm.ts";

function random(n: number, rng: Rng): Float32Array {
  const a = new Float32Array(n);
  for (let i = 0; i < n; i++) a[i] = rng.normal();
  return a;
}

/** Each binary: relaxed or plain SIMD, on a wasm32 or a Memory64 arena. */
const VARIANTS = [
  ["relaxed", false],
  ["simd", false],
  ["relaxed", true],
  ["simd", true],
] as const;

function expectClose(actual: Float32Array, expected: Float32Array, tolerance: number): void {
  expect(actual.length).toBe(expected.length);
  let worst = 0;
  for (let i = 0; i < actual.length; i++)
    worst = Math.max(worst, Math.abs(actual[i]! - expected[i]!));
  expect(worst).toBeLessThan(tolerance);
}

describe("WASM kernels", () => {
  it("when Node 24 runs them, then relaxed SIMD is detected", () => {
    expect(relaxedSimdSupported).toBe(true);
  });

  // Four modules of ~100 KB: seconds of wabt, more on a busy machine.
  it("when the generator is run, then it assembles exactly the committed binaries", async () => {
    const built = await assemble();
    expect(Object.keys(built).sort()).toEqual([
      "kernels-relaxed-64.wasm",
      "kernels-relaxed.wasm",
      "kernels-simd-64.wasm",
      "kernels-simd.wasm",
    ]);
    for (const [file, bytes] of Object.entries(built))
      expect(bytes).toEqual(
        new Uint8Array(readFileSync(new URL(`./wasm/${file}`, import.meta.url))),
      );
  });

  for (const [variant, memory64] of VARIANTS) {
    const kernels = createWasmKernels(variant, { memory64 });
    // Every row remainder (1–5 rows after blocks of 6), partial panels (N % 8) and k tails.
    const shapes = [
      [1, 5, 12],
      [2, 40, 7],
      [3, 24, 9],
      [4, 8, 4],
      [5, 13, 36],
      [7, 13, 36],
      [9, 64, 128],
      [17, 70, 33],
    ] as const;
    it(`when ${kernels.name} packs a weight larger than one packing slice (8 MB), then matmuls match the JS kernels`, () => {
      // 1,030 × 2,050 floats: W[N,K] is packed in slices of whole 8-row groups with a tail,
      // B[K,N] in slices of whole rows with a tail.
      const rng = new Rng(7);
      const [M, N, K] = [3, 1030, 2050];
      const a = random(M * K, rng);
      const w = random(N * K, rng);
      const want = new Float32Array(M * N);
      const got = new Float32Array(M * N);
      jsKernels.matmulNT(want, a, w, M, N, K);
      kernels.matmulNT(got, a, w, M, N, K, false, 1);
      expectClose(got, want, 1e-3);
      const dy = random(M * N, rng);
      const wantNN = new Float32Array(M * K);
      const gotNN = new Float32Array(M * K);
      jsKernels.matmulNN(wantNN, dy, w, M, K, N);
      kernels.matmulNN(gotNN, dy, w, M, K, N, false, 1);
      expectClose(gotNN, wantNN, 1e-3);
    });
    for (const [M, N, K] of shapes) {
      it(`when ${kernels.name} matmuls run on ${M}×${N}×${K}, then they match the JS kernels`, () => {
        const rng = new Rng(M * 1000 + N * 10 + K);
        const a = random(M * K, rng);
        const b = random(N * K, rng);
        const want = new Float32Array(M * N);
        const got = new Float32Array(M * N);
        jsKernels.matmulNT(want, a, b, M, N, K);
        kernels.matmulNT(got, a, b, M, N, K, false, 1);
        expectClose(got, want, 1e-4);
        // Accumulating, and a changed weight under a new version.
        b[0] = b[0]! + 1;
        jsKernels.matmulNT(want, a, b, M, N, K, true);
        kernels.matmulNT(got, a, b, M, N, K, true, 2);
        expectClose(got, want, 1e-4);

        const bNN = random(K * N, rng);
        const wantNN = new Float32Array(M * N);
        const gotNN = new Float32Array(M * N);
        jsKernels.matmulNN(wantNN, a, bNN, M, N, K);
        kernels.matmulNN(gotNN, a, bNN, M, N, K);
        expectClose(gotNN, wantNN, 1e-4);
        kernels.matmulNN(gotNN, a, bNN, M, N, K, false, 3);
        expectClose(gotNN, wantNN, 1e-4);

        const aTN = random(K * M, rng);
        const wantTN = random(M * N, rng);
        const gotTN = Float32Array.from(wantTN);
        jsKernels.matmulTN(wantTN, aTN, bNN, M, N, K, true);
        kernels.matmulTN(gotTN, aTN, bNN, M, N, K, true);
        expectClose(gotTN, wantTN, 1e-4);
      });

      it(`when ${kernels.name} matmuls run on ${M}×${N}×${K}, then each row has the same bits alone as in the batch`, () => {
        const rng = new Rng(M + N + K);
        const a = random(M * K, rng);
        const b = random(N * K, rng);
        const batch = new Float32Array(M * N);
        kernels.matmulNT(batch, a, b, M, N, K, false, 1);
        const row = new Float32Array(N);
        for (let m = 0; m < M; m++) {
          kernels.matmulNT(row, a.subarray(m * K, (m + 1) * K), b, 1, N, K, false, 1);
          expect(row).toEqual(batch.subarray(m * N, (m + 1) * N));
        }
      });
    }
  }

  it("when a weight-gradient GEMM sums more rows than one chunk, then it still matches JS", () => {
    const kernels = createWasmKernels();
    const rng = new Rng(77);
    const [M, N, K] = [12, 16, 300];
    const a = random(K * M, rng);
    const b = random(K * N, rng);
    const want = random(M * N, rng);
    const got = Float32Array.from(want);
    jsKernels.matmulTN(want, a, b, M, N, K, true);
    kernels.matmulTN(got, a, b, M, N, K, true);
    expectClose(got, want, 1e-3);
    jsKernels.matmulTN(want, a, b, M, N, K);
    kernels.matmulTN(got, a, b, M, N, K);
    expectClose(got, want, 1e-3);
  });

  for (const [variant, memory64] of VARIANTS) {
    const kernels = createWasmKernels(variant, { memory64 });
    it(`when ${kernels.name} rmsNorm, swiglu and attention run, then they match the JS kernels`, () => {
      const rng = new Rng(99);
      const rows = 5;
      const D = 128;
      const x = random(rows * D, rng);
      const w = random(D, rng);
      const want = new Float32Array(rows * D);
      const got = new Float32Array(rows * D);
      jsKernels.rmsNorm(want, x, w, rows, D, 1e-5);
      kernels.rmsNorm(got, x, w, rows, D, 1e-5);
      expectClose(got, want, 1e-5);
      // Saving 1/rms per row, and the backward (dx written, dw accumulated).
      const [wantInv, gotInv] = [new Float32Array(rows), new Float32Array(rows)];
      jsKernels.rmsNorm(want, x, w, rows, D, 1e-5, wantInv);
      kernels.rmsNorm(got, x, w, rows, D, 1e-5, gotInv);
      expectClose(gotInv, wantInv, 1e-5);
      const dy = random(rows * D, rng);
      const [wantDx, gotDx] = [new Float32Array(rows * D), new Float32Array(rows * D)];
      const wantDw = random(D, new Rng(8));
      const gotDw = Float32Array.from(wantDw);
      jsKernels.rmsNormBackward(wantDx, wantDw, dy, x, wantInv, w, rows, D);
      kernels.rmsNormBackward(gotDx, gotDw, dy, x, gotInv, w, rows, D);
      expectClose(gotDx, wantDx, 1e-4);
      expectClose(gotDw, wantDw, 1e-4);

      const gate = random(352, rng).map((v) => v * 10);
      const up = random(352, rng);
      const wantS = new Float32Array(352);
      const gotS = new Float32Array(352);
      jsKernels.swiglu(wantS, gate, up, 352);
      kernels.swiglu(gotS, gate, up, 352);
      expectClose(gotS, wantS, 1e-5);

      // 3 new rows at positions 6..8 against 9 cached positions, 4 query heads over 2 kv heads.
      const [H, KV, hd, n, start] = [4, 2, 64, 3, 6];
      const q = random(n * H * hd, rng);
      const keys = random((start + n) * KV * hd, rng);
      const values = random((start + n) * KV * hd, rng);
      const wantA = new Float32Array(n * H * hd);
      const gotA = new Float32Array(n * H * hd);
      jsKernels.attention(wantA, q, keys, values, n, start, H, KV, hd);
      kernels.attention(gotA, q, keys, values, n, start, H, KV, hd);
      expectClose(gotA, wantA, 1e-5);

      // Decoding: the cache grows one row per call; the kernel's arena mirror must follow it.
      const cacheK = new Float32Array(12 * KV * hd);
      const cacheV = new Float32Array(12 * KV * hd);
      for (let pos = 0; pos < 12; pos++) {
        cacheK.set(random(KV * hd, rng), pos * KV * hd);
        cacheV.set(random(KV * hd, rng), pos * KV * hd);
        const q1 = random(H * hd, rng);
        const want1 = new Float32Array(H * hd);
        const got1 = new Float32Array(H * hd);
        jsKernels.attention(want1, q1, cacheK, cacheV, 1, pos, H, KV, hd);
        kernels.attention(got1, q1, cacheK, cacheV, 1, pos, H, KV, hd);
        expectClose(got1, want1, 1e-5);
      }

      // A cache refilled from position 0 (reused for a new sequence): decode must not read the
      // arena mirror of the old contents.
      for (const pos of [0, 1, 2]) {
        const q1 = random(H * hd, rng);
        kernels.attention(new Float32Array(H * hd), q1, cacheK, cacheV, 1, pos, H, KV, hd);
      }
      cacheK.set(random(12 * KV * hd, rng));
      cacheV.set(random(12 * KV * hd, rng));
      const qPrefill = random(3 * H * hd, rng);
      kernels.attention(new Float32Array(3 * H * hd), qPrefill, cacheK, cacheV, 3, 0, H, KV, hd);
      const qNext = random(H * hd, rng);
      const [wantNext, gotNext] = [new Float32Array(H * hd), new Float32Array(H * hd)];
      jsKernels.attention(wantNext, qNext, cacheK, cacheV, 1, 3, H, KV, hd);
      kernels.attention(gotNext, qNext, cacheK, cacheV, 1, 3, H, KV, hd);
      expectClose(gotNext, wantNext, 1e-5);

      // Backward over a whole sequence of 7 rows, accumulating into non-zero gradients.
      const T = 7;
      const qs = random(T * H * hd, rng);
      const ks = random(T * KV * hd, rng);
      const vs = random(T * KV * hd, rng);
      const dOut = random(T * H * hd, rng);
      const grads = () =>
        [
          random(T * H * hd, new Rng(5)),
          random(T * KV * hd, new Rng(6)),
          random(T * KV * hd, new Rng(7)),
        ] as const;
      const [wq, wk, wv] = grads();
      const [gq, gk, gv] = grads();
      jsKernels.attentionBackward(wq, wk, wv, qs, ks, vs, dOut, T, H, KV, hd);
      kernels.attentionBackward(gq, gk, gv, qs, ks, vs, dOut, T, H, KV, hd);
      expectClose(gq, wq, 1e-4);
      expectClose(gk, wk, 1e-4);
      expectClose(gv, wv, 1e-4);

      const dOutS = random(352, rng);
      const [wg, wu, gg, gu] = [0, 0, 0, 0].map(() => new Float32Array(352)) as [
        Float32Array,
        Float32Array,
        Float32Array,
        Float32Array,
      ];
      jsKernels.swigluBackward(wg, wu, dOutS, gate, up, 352);
      kernels.swigluBackward(gg, gu, dOutS, gate, up, 352);
      expectClose(gg, wg, 1e-5);
      expectClose(gu, wu, 1e-5);

      const rows2 = 3;
      const cols = 20;
      const logits = random(rows2 * cols, rng).map((v) => v * 5);
      const scale = Float32Array.from([1, 0.5, 0]);
      const [wantX, gotX] = [Float32Array.from(logits), Float32Array.from(logits)];
      const [wm, ws, gm, gs] = [0, 0, 0, 0].map(() => new Float32Array(rows2)) as [
        Float32Array,
        Float32Array,
        Float32Array,
        Float32Array,
      ];
      jsKernels.softmaxRows(wantX, rows2, cols, scale, wm, ws);
      kernels.softmaxRows(gotX, rows2, cols, scale, gm, gs);
      expectClose(gotX, wantX, 1e-6);
      expectClose(gm, wm, 1e-7);
      expectClose(gs, ws, 1e-4);
      expect(wantX.subarray(0, cols).reduce((a, b) => a + b, 0)).toBeCloseTo(1, 5);
    });
  }
});
