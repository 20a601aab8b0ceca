/**
 * How the engine keeps weights, F32, BF16 (widened inside the GEMM) or q8 (int8 blocks, ADR 61), on one thread and a
 * Qwen3-0.6B layer's shapes (hidden 1,024, MLP 3,072) and its head (vocabulary 151,936): the
 * forward `x·Wᵀ` at decode (1 and 8 rows) and prefill (128 rows), and the backward `dY·W`,
 * which builds F32 B-panels from the packed weight per call. The two run alternately, round
 * after round, and each keeps its best: the machine is shared, so the least disturbed round is
 * the closest to the code's speed.
 * Usage: node bench/engine-weights.ts [seconds per case, default 4]
 */
import { createWasmKernels, type Kernels, packSliceRows } from "@arbor/engine/kernels";
import { printTable } from "./torch.ts";

const SECONDS = Number(process.argv[2] ?? 4);
const ROUNDS = 8;
const kernels = createWasmKernels("auto", { threads: 1 });

const shapes = [
  ["decode 1 row, gate (3,072 × 1,024)", "nt", 1, 3072, 1024],
  ["decode 8 rows, gate", "nt", 8, 3072, 1024],
  ["decode 1 row, head (151,936 × 1,024)", "nt", 1, 151936, 1024],
  ["prefill 128 rows, gate", "nt", 128, 3072, 1024],
  ["backward dY·W, 128 rows, down (1,024 × 3,072)", "nn", 128, 3072, 1024],
] as const;

type Dtype = "f32" | "bf16" | "q8";
const DTYPES = ["f32", "bf16", "q8"] as const;

function packed(k: Kernels, N: number, K: number, dtype: Dtype) {
  const w = k.packWeight!(N, K, dtype);
  const rows = packSliceRows(K);
  for (let r0 = 0; r0 < N; r0 += rows) {
    const n = Math.min(rows, N - r0);
    w.writeRows(
      r0,
      Float32Array.from({ length: n * K }, (_, i) => Math.sin(r0 * K + i) * 0.05),
    );
  }
  return w;
}

console.log(
  `\n@arbor/engine weights in F32, BF16 or q8, kernels ${kernels.name}, one thread; ms per call, best of ${ROUNDS} alternating rounds\n`,
);
printTable(
  [
    "case",
    "M × N × K",
    "F32 ms",
    "BF16 ms",
    "q8 ms",
    "BF16 / F32 time",
    "q8 / BF16 time",
    "F32 weight MB",
    "BF16 weight MB",
    "q8 weight MB",
  ],
  shapes.map(([label, kind, M, N, K]) => {
    // nt: W is [N, K]; nn: out[M, N] = a[M, K]·W with W [K, N].
    const [rows, cols] = kind === "nt" ? [N, K] : [K, N];
    const weights = {
      f32: packed(kernels, rows, cols, "f32"),
      bf16: packed(kernels, rows, cols, "bf16"),
      q8: packed(kernels, rows, cols, "q8"),
    };
    const a = Float32Array.from({ length: M * K }, (_, i) => Math.cos(i) * 0.5);
    const out = new Float32Array(M * N);
    const run = (dtype: Dtype) =>
      kind === "nt"
        ? kernels.matmulNT(out, a, weights[dtype], M, N, K)
        : kernels.matmulNN(out, a, weights[dtype], M, N, K);
    const best = { f32: Infinity, bf16: Infinity, q8: Infinity };
    for (let round = 0; round < ROUNDS; round++) {
      for (const dtype of DTYPES) {
        let calls = 0;
        const start = performance.now();
        while (performance.now() - start < (SECONDS * 1000) / ROUNDS / DTYPES.length) {
          run(dtype);
          calls++;
        }
        best[dtype] = Math.min(best[dtype], (performance.now() - start) / calls);
      }
    }
    return [
      label,
      `${M} × ${N} × ${K}`,
      best.f32.toFixed(3),
      best.bf16.toFixed(3),
      best.q8.toFixed(3),
      (best.bf16 / best.f32).toFixed(2),
      (best.q8 / best.bf16).toFixed(2),
      (weights.f32.bytes / 1e6).toFixed(1),
      (weights.bf16.bytes / 1e6).toFixed(1),
      (weights.q8.bytes / 1e6).toFixed(1),
    ];
  }),
);
