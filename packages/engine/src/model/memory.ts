import { q8Bytes, q8Fits } from "../kernels/q8.ts";
import type { WeightDtype } from "../kernels/types.ts";
import { panelBytes } from "../kernels/wasm.ts";
import type { ModelConfig } from "./config.ts";

/** How a model holds its weights: plain F32 arrays (which kernels pack beside them), or packed
 * in the kernels as their only copy, in F32, BF16 or q8 (see `loadModel`). */
export type WeightStorage = "plain" | WeightDtype;

/**
 * Work that does not fit the kernels' memory, found before any of it is done: it needs `needed`
 * bytes and the arena holds `available`. A caller on a wasm32 arena may run it again on a
 * Memory64 one (`createWasmKernels(…, { memory64: true })`).
 */
export class EngineMemoryError extends Error {
  override readonly name: string = "EngineMemoryError";
  readonly needed: number;
  readonly available: number;

  constructor(message: string, needed: number, available: number) {
    super(message);
    this.needed = needed;
    this.available = available;
  }
}

/**
 * Bytes of the kernels' memory a model's weights take, kept between passes: every Linear weight
 * and the head, packed into GEMM panels; for a model loaded packed (`storage` "f32" or "bf16")
 * also untied embeddings. Serving and training alike hold them (`trainingMemory`'s `weights`).
 */
export function packedWeightBytes(config: ModelConfig, storage: WeightStorage = "plain"): number {
  const { hiddenSize: D, intermediateSize: I, numLayers: L, vocabSize: V } = config;
  const q = config.numHeads * config.headDim;
  const kv = config.numKvHeads * config.headDim;
  /** A [rows, cols] weight's bytes in F32 panels (plain weights too), BF16 or q8. */
  const bytes = (rows: number, cols: number) => {
    if (storage === "q8" && q8Fits(rows, cols)) return q8Bytes(rows, cols);
    const f32 = panelBytes(rows, cols);
    return storage === "bf16" || storage === "q8" ? f32 / 2 : f32;
  };
  const layer = bytes(q, D) + 2 * bytes(kv, D) + bytes(D, q) + 2 * bytes(I, D) + bytes(D, I);
  // Plain weights are packed in F32 beside their arrays (the embeddings stay outside); packed
  // ones are the only copy, untied embeddings included, in F32, BF16 (half the bytes) or q8
  // (9 bits a weight; a shape q8 cannot hold is kept in BF16).
  const tables = storage !== "plain" && !config.tieWordEmbeddings ? 2 : 1;
  return L * layer + tables * bytes(V, D);
}
