import type { WeightDtype } from "../kernels/types.ts";
import { panelBytes } from "../kernels/wasm.ts";
import type { ModelConfig } from "./config.ts";

/** How a model holds its weights: plain F32 arrays (which kernels pack beside them), or packed
 * in the kernels as their only copy, in F32 or BF16 (see `loadModel`). */
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
  const layer =
    panelBytes(q, D) +
    2 * panelBytes(kv, D) +
    panelBytes(D, q) +
    2 * panelBytes(I, D) +
    panelBytes(D, I);
  // Plain weights are packed in F32 beside their arrays (the embeddings stay outside); packed
  // ones are the only copy, untied embeddings included, in F32 or BF16 (half the bytes).
  const tables = storage !== "plain" && !config.tieWordEmbeddings ? 2 : 1;
  const f32 = L * layer + tables * panelBytes(V, D);
  return storage === "bf16" ? f32 / 2 : f32;
}
