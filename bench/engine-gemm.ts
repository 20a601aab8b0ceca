/**
 * GFLOP/s of the engine's GEMM kernels on one thread, on the tiny-chat shapes (copies into the
 * kernels' arena included, as the model calls them), beside the plain-JS reference kernel.
 * Usage: node bench/engine-gemm.ts
 */
import { createWasmKernels, jsKernels, type Kernels } from "@arbor/engine/kernels";
import { printTable } from "./torch.ts";

const wasm = createWasmKernels("auto", { threads: 1 });
const shapes = [
  ["x·Wᵀ (forward), prefill 1 × 128, q", "nt", 128, 128, 128],
  ["x·Wᵀ (forward), prefill 8 × 128, gate", "nt", 1024, 352, 128],
  ["x·Wᵀ (forward), training 32 × 128, lm head", "nt", 4096, 768, 128],
  ["x·Wᵀ (forward), decode 1 sequence, gate", "nt", 1, 352, 128],
  ["x·Wᵀ (forward), decode 8 sequences, gate", "nt", 8, 352, 128],
  ["dY·W (backward), training, down", "nn", 4096, 352, 128],
  ["dYᵀ·X (weight gradient), training, gate", "tn", 352, 128, 4096],
] as const;

function gflops(
  k: Kernels,
  kind: string,
  M: number,
  N: number,
  K: number,
  seconds: number,
): number {
  const rnd = (n: number) => Float32Array.from({ length: n }, (_, i) => Math.sin(i) * 0.5);
  const a = rnd(M * K);
  const b = rnd(N * K);
  const out = new Float32Array(M * N);
  const run = () =>
    kind === "nt"
      ? k.matmulNT(out, a, b, M, N, K, false, 1)
      : kind === "nn"
        ? k.matmulNN(out, a, b, M, N, K, false, 1)
        : k.matmulTN(out, a, b, M, N, K);
  run();
  // The machine is shared: best of 5 rounds of `seconds` / 5 each.
  let best = 0;
  for (let round = 0; round < 5; round++) {
    let calls = 0;
    const start = performance.now();
    while (performance.now() - start < (seconds * 1000) / 5) {
      run();
      calls++;
    }
    best = Math.max(best, (2 * M * N * K * calls) / ((performance.now() - start) / 1000) / 1e9);
  }
  return best;
}

console.log(`\n@arbor/engine GEMM, kernels ${wasm.name}, one thread; GFLOP/s, best of 5 rounds\n`);
printTable(
  ["shape", "M × N × K", "WASM", "plain JS", "WASM / JS"],
  shapes.map(([label, kind, M, N, K]) => {
    const fast = gflops(wasm, kind, M, N, K, 1);
    const slow = gflops(jsKernels, kind, M, N, K, 0.5);
    return [label, `${M} × ${N} × ${K}`, fast.toFixed(1), slow.toFixed(1), fast / slow];
  }),
);
