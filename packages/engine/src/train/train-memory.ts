import type { Kernels } from "../kernels/types.ts";
import { B_SLAB_BYTES, memory64Limit, PACK_SLICE, panelBytes } from "../kernels/wasm.ts";
import type { ModelConfig } from "../model/config.ts";
import { EngineMemoryError, packedWeightBytes, type WeightStorage } from "../model/memory.ts";

/**
 * What a training pass (forward with saved activations, then backward) needs of the kernels'
 * memory, in bytes: `rows` rows need `weights + fixed + perRow · rows`. Upper bounds: a test
 * checks them against the arena's high-water mark for every family.
 */
export interface TrainingMemory {
  /** The packed weights, kept between passes (`packedWeightBytes`). */
  weights: number;
  /** Scratch of the largest call: a weight's B-panels packed per backward call (a slab of them
   * for packed weights), and the slice it is copied through. */
  fixed: number;
  /** Activations saved for the backward, the backward's own per-layer arrays, and the logits. */
  perRow: number;
  /**
   * `perRow` when activations are recomputed (`LossOptions.recompute`): each layer's input is
   * kept, and one layer's activations at a time are computed again in the backward.
   */
  perRowRecompute: number;
}

export function trainingMemory(
  config: ModelConfig,
  storage: WeightStorage = "plain",
): TrainingMemory {
  const { hiddenSize: D, intermediateSize: I, numLayers: L, vocabSize: V, qkNorm } = config;
  const q = config.numHeads * config.headDim;
  const kv = config.numKvHeads * config.headDim;
  // The backward's dX = dY·W packs W as B-panels per call: the head's is the largest (V ≥ I).
  // Plain weights are packed whole, through a slice; packed ones a slab of at most
  // B_SLAB_BYTES at a time (loading packs through a slice and, for BF16, F32 panels of it).
  const panels = Math.max(panelBytes(D, V), panelBytes(D, I), panelBytes(I, D));
  const fixed =
    storage === "plain" ? panels + PACK_SLICE : Math.min(panels, B_SLAB_BYTES) + 3 * PACK_SLICE;
  const norms = qkNorm ? q + kv + config.numHeads + config.numKvHeads : 0;
  const saved = 4 * D + 2 * q + 2 * kv + 3 * I + 2 + norms;
  const backward = 2 * D + 3 * I + 2 * q + 2 * kv + (qkNorm ? q + kv : 0);
  // Embeddings, the final norm's input, output and gradients, the rows gathered for the head
  // and their gradients (`maskedRowsOnly`), the logits (twice when a row of V is not a whole
  // panel and goes through scratch), and per-row statistics.
  const head = 6 * D + V + (V % 8 === 0 ? 0 : V + 8) + 8;
  // A GEMM on q8 weights quantizes its input rows in scratch: 2 bytes and a scale per 32 a value.
  const quantized = storage === "q8" ? Math.ceil(2.125 * Math.max(D, I, q)) : 0;
  return {
    weights: packedWeightBytes(config, storage),
    fixed,
    perRow: 4 * (L * saved + backward + head) + quantized,
    // The layers' inputs, one layer's activations and the output it recomputes into.
    perRowRecompute: 4 * (L * D + saved + D + backward + head) + quantized,
  };
}

/**
 * Rows a micro-batch can hold within the kernels' memory (Infinity when unbounded), with every
 * activation saved or (`recompute`) recomputed in the backward.
 */
export function rowsThatFit(
  config: ModelConfig,
  kernels: Kernels,
  storage: WeightStorage = "plain",
  recompute = false,
): number {
  if (!Number.isFinite(kernels.memoryLimit)) return Number.POSITIVE_INFINITY;
  const { weights, fixed, perRow, perRowRecompute } = trainingMemory(config, storage);
  const row = recompute ? perRowRecompute : perRow;
  return Math.max(0, Math.floor((kernels.memoryLimit - weights - fixed) / row));
}

/** How a training pass's micro-batches are cut: at most `tokens` rows each, and whether their
 * activations are recomputed in the backward. */
export interface MicroBatchPlan {
  tokens: number;
  recompute: boolean;
}

const GB = (bytes: number) => `${(bytes / 1e9).toFixed(2)} GB`;

/**
 * The micro-batches for training on `sequences`: `budget` tokens, lowered to what the kernels'
 * memory holds. When even the longest sequence alone does not fit with its activations saved,
 * a Memory64 arena (the largest there is) recomputes them in the backward, one layer at a time
 * (one more forward per step); a wasm32 one refuses, so that its caller moves the work to
 * Memory64, which costs less. When that does not fit either, it throws an EngineMemoryError naming the
 * memory needed and available, so a job fails before its first step, never mid-way.
 */
export function microBatchBudget(
  config: ModelConfig,
  kernels: Kernels,
  sequences: readonly { tokens: readonly number[] }[],
  budget: number,
  storage: WeightStorage = "plain",
): MicroBatchPlan {
  let longest = 0;
  for (const s of sequences) longest = Math.max(longest, s.tokens.length);
  const fit = rowsThatFit(config, kernels, storage);
  if (longest <= fit) return { tokens: Math.max(longest, Math.min(budget, fit)), recompute: false };
  // Recomputing on the largest arena there is: a Memory64 one, or a wasm32 one where Memory64
  // would be smaller (a container of less than about 5.3 GB).
  const recompute = kernels.memory64 === true || memory64Limit() <= kernels.memoryLimit;
  const fitRecomputing = recompute ? rowsThatFit(config, kernels, storage, true) : 0;
  if (longest <= fitRecomputing) {
    return { tokens: Math.max(longest, Math.min(budget, fitRecomputing)), recompute: true };
  }
  const { weights, fixed, perRow, perRowRecompute } = trainingMemory(config, storage);
  const row = recompute ? perRowRecompute : perRow;
  const needed = weights + fixed + row * longest;
  throw new EngineMemoryError(
    `not enough engine memory to train on a ${longest}-token sequence: it needs ${GB(needed)} ` +
      `(${GB(weights)} of packed weights, ${GB(row * longest)} of activations${recompute ? " recomputed layer by layer" : ""}, ${GB(fixed)} of scratch), ` +
      `and the engine has ${GB(kernels.memoryLimit)}; use shorter examples or a smaller base model`,
    needed,
    kernels.memoryLimit,
  );
}
