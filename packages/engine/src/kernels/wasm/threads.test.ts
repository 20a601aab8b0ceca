import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import { randomBatch, tinyModel } from "../../../test/fixtures.ts";
import { Rng } from "../../model/rng.ts";
import { parameters, zerosLike } from "../../model/weights.ts";
import { lossAndGradients } from "../../train/train.ts";
import { jsKernels } from "../js.ts";
import type { KernelExports } from "../table.ts";
import type { Kernels } from "../types.ts";
import { createWasmKernels } from "../wasm.ts";
import { call } from "./jobs.ts";
import { CLAIM, claim, ThreadPool } from "./pool.ts";

function random(n: number, rng: Rng): Float32Array {
  const a = new Float32Array(n);
  for (let i = 0; i < n; i++) a[i] = rng.normal();
  return a;
}

/** Runs `f` on fresh outputs with each kernel set and returns what each wrote. */
function outputs(kernels: Kernels[], f: (k: Kernels) => Float32Array[]): Float32Array[][] {
  return kernels.map((k) => f(k));
}

describe("kernels on worker threads", () => {
  const one = createWasmKernels("auto", { threads: 1 });
  const two = createWasmKernels("auto", { threads: 2 });
  const three = createWasmKernels("auto", { threads: 3 });
  const all = [one, two, three];

  it("when GEMMs large enough to split run on 1, 2 and 3 threads, then the bits are the same", () => {
    const rng = new Rng(3);
    // 301 rows: the row split leaves uneven shares and a 1-row tail.
    const [M, N, K] = [301, 72, 130];
    const a = random(M * K, rng);
    const w = random(N * K, rng);
    const bKN = random(K * N, rng);
    const aT = random(K * M, rng);
    const start = random(M * N, rng);
    const results = outputs(all, (k) => {
      const nt = Float32Array.from(start);
      k.matmulNT(nt, a, w, M, N, K, true, 1);
      const nn = new Float32Array(M * N);
      k.matmulNN(nn, a, bKN, M, N, K);
      const tn = Float32Array.from(start);
      k.matmulTN(tn, aT, bKN, M, N, K, true);
      return [nt, nn, tn];
    });
    expect(two.splitCalls).toBe(3);
    expect(three.splitCalls).toBe(3);
    expect(one.splitCalls).toBe(0);
    expect(results[1]).toEqual(results[0]);
    expect(results[2]).toEqual(results[0]);
    const want = new Float32Array(M * N);
    jsKernels.matmulNN(want, a, bKN, M, N, K);
    let worst = 0;
    for (let i = 0; i < want.length; i++)
      worst = Math.max(worst, Math.abs(want[i]! - results[1]![1]![i]!));
    expect(worst).toBeLessThan(1e-3);
  });

  it("when GEMMs on weights packed in F32 and BF16 split among 1, 2 and 3 threads, then the bits are the same, and BF16 gives its widened F32's sums", async () => {
    const rng = new Rng(8);
    const [M, N, K] = [301, 72, 130];
    const a = random(M * K, rng);
    const w = random(N * K, rng);
    const dY = random(M * N, rng);
    // Kernels of its own: the other tests count the shared ones' split calls.
    const sets = [1, 2, 3].map((threads) => createWasmKernels("auto", { threads }));
    const results = outputs(sets, (k) =>
      (["f32", "bf16"] as const).flatMap((dtype) => {
        const packed = k.packWeight!(N, K, dtype);
        packed.writeRows(0, w);
        const nt = new Float32Array(M * N);
        k.matmulNT(nt, a, packed, M, N, K);
        const nn = new Float32Array(M * K);
        k.matmulNN(nn, dY, packed, M, K, N);
        // The same product on the weight as plain F32 arrays (BF16: widened), packed per call.
        const plain = packed.readRows(0, N);
        const ntPlain = new Float32Array(M * N);
        k.matmulNT(ntPlain, a, plain, M, N, K);
        const nnPlain = new Float32Array(M * K);
        k.matmulNN(nnPlain, dY, plain, M, K, N);
        expect(nt).toEqual(ntPlain);
        expect(nn).toEqual(nnPlain);
        return [nt, nn];
      }),
    );
    expect(results[1]).toEqual(results[0]);
    expect(results[2]).toEqual(results[0]);
    // BF16 rounded the weight: its results differ from F32's (the test sees both dtypes).
    expect(results[0]![2]).not.toEqual(results[0]![0]);
    expect(sets[1]!.splitCalls).toBeGreaterThan(0);
    await Promise.all(sets.map((k) => k.close()));
  });

  it("when a few rows (decoding 1–12 sequences) meet a weight large enough to split, then its columns are split among the threads, with the same bits", async () => {
    const rng = new Rng(12);
    // 259 columns: 33 panels, split unevenly, the last one partial.
    const [N, K] = [259, 8200];
    const w = random(N * K, rng);
    const sets = [1, 2, 3].map((threads) => createWasmKernels("auto", { threads }));
    const results = outputs(sets, (k) =>
      (["f32", "bf16"] as const).flatMap((dtype) => {
        const packed = k.packWeight!(N, K, dtype);
        packed.writeRows(0, w);
        return [1, 5, 8, 10, 12].flatMap((M) => {
          const start = random(M * N, new Rng(M));
          const a = random(M * K, new Rng(M + 1));
          const out = Float32Array.from(start);
          k.matmulNT(out, a, packed, M, N, K, true);
          // Each row alone (a 1-row tile) gives the bits of the batch's (half-panel) tiles.
          const alone = Float32Array.from(start);
          for (let m = 0; m < M; m++) {
            const row = alone.subarray(m * N, (m + 1) * N);
            k.matmulNT(row, a.subarray(m * K, (m + 1) * K), packed, 1, N, K, true);
          }
          return [out, alone];
        });
      }),
    );
    expect(results[1]).toEqual(results[0]);
    expect(results[2]).toEqual(results[0]);
    for (let i = 0; i < results[0]!.length; i += 2)
      expect(results[0]![i]).toEqual(results[0]![i + 1]);
    // Every product was split on 2 and 3 threads (the batches and their rows), none on one.
    expect(sets.map((k) => k.splitCalls)).toEqual([0, 82, 82]);
    await Promise.all(sets.map((k) => k.close()));
  });

  it("when attention splits rows (prefill) or sequences (training), then the bits are the same", () => {
    const rng = new Rng(4);
    const [H, KV, hd, n, start] = [4, 2, 64, 150, 10];
    const q = random(n * H * hd, rng);
    const keys = random((start + n) * KV * hd, rng);
    const values = random((start + n) * KV * hd, rng);
    const S = 5;
    const T = 48;
    const qs = random(S * T * H * hd, rng);
    const ks = random(S * T * KV * hd, rng);
    const vs = random(S * T * KV * hd, rng);
    const dOut = random(S * T * H * hd, rng);
    const results = outputs(all, (k) => {
      const prefill = new Float32Array(n * H * hd);
      k.attention(prefill, q, keys, values, n, start, H, KV, hd);
      const stacked = new Float32Array(S * T * H * hd);
      k.attention(stacked, qs, ks, vs, T, 0, H, KV, hd, S);
      const [dq, dk, dv] = [S * T * H * hd, S * T * KV * hd, S * T * KV * hd].map(
        (size) => new Float32Array(size),
      ) as [Float32Array, Float32Array, Float32Array];
      k.attentionBackward(dq, dk, dv, qs, ks, vs, dOut, T, H, KV, hd, S);
      return [prefill, stacked, dq, dk, dv];
    });
    expect(two.splitCalls).toBe(3 + 3);
    expect(results[1]).toEqual(results[0]);
    expect(results[2]).toEqual(results[0]);
    // Stacked sequences give what one call per sequence gives.
    const seq1 = new Float32Array(T * H * hd);
    one.attention(
      seq1,
      qs.subarray(T * H * hd),
      ks.subarray(T * KV * hd),
      vs.subarray(T * KV * hd),
      T,
      0,
      H,
      KV,
      hd,
    );
    expect(seq1).toEqual(results[0]![1]!.subarray(T * H * hd, 2 * T * H * hd));
  });

  it("when a training step's forward and backward run on 2 threads, then loss and gradients have the same bits", () => {
    const model = tinyModel(5, { hiddenSize: 64, intermediateSize: 128, headDim: 32 });
    const batch = randomBatch(model.config.vocabSize, 8, 48, 9);
    const run = (k: Kernels) => {
      const grads = zerosLike(model.weights);
      const { loss } = lossAndGradients(model, k, batch, grads);
      return { loss, grads: parameters(model.config, grads).map((p) => p.data) };
    };
    const single = run(one);
    const before = two.splitCalls;
    const threaded = run(two);
    expect(two.splitCalls - before).toBeGreaterThan(10);
    expect(threaded.loss).toBe(single.loss);
    expect(threaded.grads).toEqual(single.grads);
  });

  it("when many split calls run back to back on more threads than cores, then every task runs once", () => {
    // Accumulating calls: a task run twice, or skipped, would change the sum.
    const rng = new Rng(12);
    const [M, N, K] = [192, 128, 96];
    const a = random(M * K, rng);
    const w = random(N * K, rng);
    const [single, threaded] = [new Float32Array(M * N), new Float32Array(M * N)];
    const before = three.splitCalls;
    for (let i = 0; i < 200; i++) {
      one.matmulNT(single, a, w, M, N, K, true, 1);
      three.matmulNT(threaded, a, w, M, N, K, true, 1);
    }
    expect(three.splitCalls - before).toBe(200);
    expect(threaded).toEqual(single);
  });

  it("when a helper cannot load, then the first split call fails at once, saying why", () => {
    const memory = new WebAssembly.Memory({ initial: 1, maximum: 16, shared: true });
    const pool = new ThreadPool(
      new WebAssembly.Module(readFileSync(new URL("./kernels-simd.wasm", import.meta.url))),
      memory,
      1,
      new URL("./no-such-helper.ts", import.meta.url),
    );
    const nothing = call("swiglu", { out: 0, gate: 0, up: 0, n: 0 });
    expect(() => pool.run({} as KernelExports, [nothing, nothing])).toThrow(
      /failed to start: .*no-such-helper/,
    );
  });

  it("when the kernels are closed, then their helpers stop and later calls run on this thread", async () => {
    const kernels = createWasmKernels("auto", { threads: 2 });
    const rng = new Rng(21);
    const [M, N, K] = [192, 128, 96];
    const [a, w] = [random(M * K, rng), random(N * K, rng)];
    const [before, after] = [new Float32Array(M * N), new Float32Array(M * N)];
    kernels.matmulNT(before, a, w, M, N, K, false, 1);
    await kernels.close();
    const split = kernels.splitCalls;
    kernels.matmulNT(after, a, w, M, N, K, false, 1);
    expect(kernels.splitCalls).toBe(split);
    expect(after).toEqual(before);
  });

  it("when a claim names another call or the tasks are used up, then nothing is claimed", () => {
    const i32 = new Int32Array(new SharedArrayBuffer(64));
    Atomics.store(i32, CLAIM, (7 << 16) | (2 << 8));
    expect([claim(i32, 7), claim(i32, 7), claim(i32, 7)]).toEqual([0, 1, -1]);
    // A helper late for call 7 finds call 8 published: the tag differs, whatever its size, so
    // it cannot run a task of call 8 as if it were of call 7 (which would run it twice).
    Atomics.store(i32, CLAIM, (8 << 16) | (250 << 8));
    expect(claim(i32, 7)).toBe(-1);
    expect(claim(i32, 8)).toBe(0);
  });
});
