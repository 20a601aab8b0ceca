import { describe, expect, it } from "vitest";
import { Rng } from "../model/rng.ts";
import { jsKernels } from "./js.ts";
import {
  dequantizeQ8Rows,
  matmulQ8Reference,
  q8Bytes,
  quantizeActivations,
  quantizeQ8Rows,
} from "./q8.ts";
import { createWasmKernels } from "./wasm.ts";

function random(n: number, rng: Rng, scale = 1): Float32Array {
  const a = new Float32Array(n);
  for (let i = 0; i < n; i++) a[i] = rng.normal() * scale;
  return a;
}

/** Largest |a − b| relative to the largest |b|. */
function relativeError(a: Float32Array, b: Float32Array): number {
  let worst = 0;
  let size = 0;
  for (let i = 0; i < a.length; i++) {
    worst = Math.max(worst, Math.abs(a[i]! - b[i]!));
    size = Math.max(size, Math.abs(b[i]!));
  }
  return worst / size;
}

/** Each binary: relaxed or plain SIMD, on a wasm32 or a Memory64 arena. */
const VARIANTS = [
  ["relaxed", false],
  ["simd", false],
  ["relaxed", true],
  ["simd", true],
] as const;

describe("q8 weights", () => {
  it("when a weight is quantized, then every weight is within half a step of its block's scale, and read back as d·q", () => {
    const rng = new Rng(3);
    const [N, K] = [12, 96];
    const w = random(N * K, rng);
    w.fill(0, 32, 64); // an all-zero block
    const bytes = new Uint8Array(q8Bytes(N, K));
    quantizeQ8Rows(bytes, K, 0, w);
    const back = dequantizeQ8Rows(bytes, K, 0, N, new Float32Array(N * K));
    for (let r = 0; r < N; r++) {
      for (let b = 0; b < K / 32; b++) {
        let max = 0;
        for (let t = 0; t < 32; t++) max = Math.max(max, Math.abs(w[r * K + b * 32 + t]!));
        // The scale is max/127 rounded up to BF16: at most 2^-8 more.
        const step = (max / 127) * (1 + 2 ** -8);
        for (let t = 0; t < 32; t++) {
          const i = r * K + b * 32 + t;
          expect(Math.abs(back[i]! - w[i]!)).toBeLessThanOrEqual(step / 2 + 1e-12);
        }
      }
    }
    expect(back.subarray(32, 64).every((v) => v === 0)).toBe(true);
    // Rows written in two calls give the same bytes as one.
    const twice = new Uint8Array(bytes.length);
    quantizeQ8Rows(twice, K, 0, w.subarray(0, 8 * K));
    quantizeQ8Rows(twice, K, 8, w.subarray(8 * K));
    expect(twice).toEqual(bytes);
  });

  it("when activations are quantized, then they are offset bytes within half a step", () => {
    const rng = new Rng(4);
    const [M, K] = [3, 64];
    const a = random(M * K, rng);
    a.fill(0, 64, 96);
    const { u, s } = quantizeActivations(a, M, K);
    for (let i = 0; i < M * K; i++) {
      expect(u[i]).toBeLessThanOrEqual(254);
      const scale = s[Math.floor(i / 32)]!;
      expect(Math.abs((u[i]! - 127) * scale - a[i]!)).toBeLessThanOrEqual(scale * 0.5001 + 1e-12);
    }
    expect(s[2]).toBe(0);
  });

  it("when the reference q8 GEMM runs, then it is within quantization error of the F32 product", () => {
    const rng = new Rng(5);
    const [M, N, K] = [4, 16, 256];
    const a = random(M * K, rng);
    const w = random(N * K, rng);
    const bytes = new Uint8Array(q8Bytes(N, K));
    quantizeQ8Rows(bytes, K, 0, w);
    const want = new Float32Array(M * N);
    jsKernels.matmulNT(want, a, w, M, N, K);
    const got = new Float32Array(M * N);
    matmulQ8Reference(got, a, bytes, M, N, K);
    // About 1/127/√3 relative error per factor, summed over √K products.
    expect(relativeError(got, want)).toBeLessThan(0.015);
  });

  for (const [variant, memory64] of VARIANTS) {
    const kernels = createWasmKernels(variant, { memory64 });
    // Every row remainder (1–3 after tiles of 4), quad remainders (N/4 % 4), one block and many.
    const shapes = [
      [1, 4, 32],
      [1, 20, 64],
      [2, 12, 96],
      [3, 8, 32],
      [4, 16, 128],
      [5, 28, 64],
      [7, 24, 160],
      [9, 40, 256],
      [13, 36, 96],
    ] as const;
    for (const [M, N, K] of shapes) {
      it(`when ${kernels.name} runs a q8 GEMM on ${M}×${N}×${K}, then it matches the JS reference, and each row has the same bits alone`, () => {
        const rng = new Rng(M * 100 + N + K);
        const a = random(M * K, rng);
        const w = random(N * K, rng, 0.05);
        const packed = kernels.packWeight(N, K, "q8");
        expect(packed.dtype).toBe("q8");
        expect(packed.bytes).toBe((N * K * 9) / 8);
        packed.writeRows(0, w);
        const bytes = new Uint8Array(q8Bytes(N, K));
        quantizeQ8Rows(bytes, K, 0, w);
        const want = new Float32Array(M * N);
        matmulQ8Reference(want, a, bytes, M, N, K);
        const got = new Float32Array(M * N);
        kernels.matmulNT(got, a, packed, M, N, K);
        expect(relativeError(got, want)).toBeLessThan(1e-5);
        // Accumulating onto the output.
        const start = random(M * N, rng);
        const wantAcc = Float32Array.from(start);
        matmulQ8Reference(wantAcc, a, bytes, M, N, K, true);
        const gotAcc = Float32Array.from(start);
        kernels.matmulNT(gotAcc, a, packed, M, N, K, true);
        expect(relativeError(gotAcc, wantAcc)).toBeLessThan(1e-5);
        const row = new Float32Array(N);
        for (let m = 0; m < M; m++) {
          kernels.matmulNT(row, a.subarray(m * K, (m + 1) * K), packed, 1, N, K);
          expect(row).toEqual(got.subarray(m * N, (m + 1) * N));
        }
        // Read back, and dX = dY·W through the dequantized weight (a backward).
        const deq = dequantizeQ8Rows(bytes, K, 0, N, new Float32Array(N * K));
        expect(packed.readRows(0, N)).toEqual(deq);
        const dy = random(M * N, rng);
        const wantNN = new Float32Array(M * K);
        jsKernels.matmulNN(wantNN, dy, deq, M, K, N);
        const gotNN = new Float32Array(M * K);
        kernels.matmulNN(gotNN, dy, packed, M, K, N);
        expect(relativeError(gotNN, wantNN)).toBeLessThan(1e-5);
        packed.release();
      });
    }
  }

  it("when a q8 GEMM is shared among threads, then it gives the single thread's bits", async () => {
    const one = createWasmKernels("auto");
    const two = createWasmKernels("auto", { threads: 2 });
    const rng = new Rng(11);
    for (const [M, N, K] of [
      [1, 4096, 576],
      [64, 256, 512],
    ] as const) {
      const a = random(M * K, rng);
      const w = random(N * K, rng, 0.05);
      const run = (k: typeof one) => {
        const packed = k.packWeight(N, K, "q8");
        packed.writeRows(0, w);
        const out = new Float32Array(M * N);
        k.matmulNT(out, a, packed, M, N, K);
        packed.release();
        return out;
      };
      const splits = two.splitCalls;
      expect(run(two)).toEqual(run(one));
      expect(two.splitCalls).toBeGreaterThan(splits);
    }
    await two.close();
  });

  it("when several q8 weights share an input, then each output has the bits of its own GEMM, on one thread or two", async () => {
    const one = createWasmKernels("auto");
    const two = createWasmKernels("auto", { threads: 2 });
    const rng = new Rng(13);
    const K = 576;
    const Ns = [576, 192, 192];
    for (const M of [1, 3, 128]) {
      const a = random(M * K, rng);
      const ws = Ns.map((N) => random(N * K, rng, 0.05));
      const run = (k: typeof one, shared: boolean) => {
        const packed = Ns.map((N, i) => {
          const p = k.packWeight(N, K, "q8");
          p.writeRows(0, ws[i]!);
          return p;
        });
        const outs = Ns.map((N) => new Float32Array(M * N));
        if (shared) k.matmulNTShared(outs, a, packed, M, Ns, K);
        else
          outs.forEach((out, i) => {
            k.matmulNT(out, a, packed[i]!, M, Ns[i]!, K);
          });
        for (const p of packed) p.release();
        return outs;
      };
      const alone = run(one, false);
      expect(run(one, true)).toEqual(alone);
      expect(run(two, true)).toEqual(alone);
    }
    await two.close();
  });

  it("when a shape q8 cannot hold is packed, then it is kept in BF16", () => {
    const kernels = createWasmKernels("auto");
    expect(kernels.packWeight(6, 64, "q8").dtype).toBe("bf16");
    expect(kernels.packWeight(8, 40, "q8").dtype).toBe("bf16");
  });
});
