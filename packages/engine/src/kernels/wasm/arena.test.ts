import { describe, expect, it } from "vitest";
import { createWasmKernels } from "../wasm.ts";
import { ArenaAllocator } from "./arena.ts";

describe("arena allocator", () => {
  it("when blocks are freed in any order, then holes merge and the top comes back down", () => {
    const heap = new ArenaAllocator(64);
    const a = heap.alloc(100);
    const b = heap.alloc(64);
    const c = heap.alloc(1000);
    expect([a, b, c]).toEqual([64, 192, 256]);
    heap.free(b, 64);
    // A small block reuses the hole; a big one goes on top.
    expect(heap.alloc(10)).toBe(192);
    expect(heap.alloc(5000)).toBe(256 + 1024);
    heap.free(192, 10);
    heap.free(a, 100);
    expect(heap.used).toBe(1024 + 5056);
    heap.free(c, 1000);
    heap.free(256 + 1024, 5000);
    expect(heap.top).toBe(64);
    expect(heap.used).toBe(0);
  });

  it("when a workspace is released and another is made, then its memory is reused and zeroed", () => {
    const kernels = createWasmKernels("auto", { threads: 1 });
    const ws = kernels.workspace();
    const a = ws.f32(1000);
    a.fill(7);
    ws.release();
    const again = kernels.workspace();
    const b = again.f32(1000);
    expect(b.byteOffset).toBe(a.byteOffset);
    expect(b.every((v) => v === 0)).toBe(true);
    // GEMM operands in the workspace are used in place and give what plain arrays give.
    const [M, N, K] = [7, 16, 12];
    const x = again.f32(M * K).map((_, i) => Math.sin(i));
    const w = Float32Array.from({ length: N * K }, (_, i) => Math.cos(i));
    const inPlace = again.f32(M * N);
    const plain = new Float32Array(M * N);
    kernels.matmulNT(inPlace, x, w, M, N, K, false, 1);
    kernels.matmulNT(plain, Float32Array.from(x), w, M, N, K, false, 1);
    expect(inPlace).toEqual(plain);
    again.release();
  });
});
