/**
 * How far a model's weights in one storage (q8) move its next-token distributions from another
 * (BF16 or F32) over a fixed text: llama.cpp's KL-divergence metric (`llama-perplexity
 * --kl-divergence`), the mean over positions of KL(P_ref ‖ P_test), and how often both put the
 * same token first.
 */
import type { Kernels } from "../kernels/types.ts";
import { createKvCache, forwardBatch, releaseKvCache } from "./forward.ts";
import type { Model } from "./model.ts";

/** A fixed English text to measure on (a few hundred tokens for a real tokenizer). */
export const QUALITY_TEXT = `The river town woke slowly. Before the sun cleared the hills, the baker had lit her ovens and
the ferryman was already checking the ropes that held his flat boat to the pier. Children ran
along the embankment with bread still warm in their hands, and the schoolteacher, who had lived
there for forty years, counted them as they passed, as she did every morning. In the market,
traders argued about the price of apples, the weather, and whether the new bridge upriver would
bring more visitors or fewer. Nobody agreed, which was how they liked it. By noon the square
was full: a man repaired clocks under a green awning, two sisters sold honey from their own
hives, and a boy played the violin badly but with great confidence. When the rain came in the
afternoon, everyone crowded under the arches of the old hall and went on talking, because in a
small town there is always more to say than there is time to say it.`;

/** The logits after each of `tokens` (decoded one token at a time against a KV cache). */
export function positionLogits(
  model: Model,
  kernels: Kernels,
  tokens: readonly number[],
): Float32Array[] {
  const cache = createKvCache(model, tokens.length);
  try {
    return tokens.map((token) => forwardBatch(model, kernels, [{ cache, tokens: [token] }])[0]!);
  } finally {
    releaseKvCache(cache);
  }
}

/** log-softmax of one row, in F64. */
function logSoftmax(logits: Float32Array): Float64Array {
  let max = -Infinity;
  for (const v of logits) max = Math.max(max, v);
  let sum = 0;
  for (const v of logits) sum += Math.exp(v - max);
  const lse = max + Math.log(sum);
  return Float64Array.from(logits, (v) => v - lse);
}

function argmax(a: ArrayLike<number>): number {
  let best = 0;
  for (let i = 1; i < a.length; i++) if (a[i]! > a[best]!) best = i;
  return best;
}

export interface DistributionDistance {
  /** Mean over positions of KL(P_ref ‖ P_test), in nats. */
  meanKld: number;
  /** The largest KL at one position. */
  maxKld: number;
  /** Fraction of positions whose most likely token is the same. */
  top1: number;
  positions: number;
}

/** KL divergence and top-1 agreement of `test`'s next-token distributions from `reference`'s. */
export function distributionDistance(
  reference: readonly Float32Array[],
  test: readonly Float32Array[],
): DistributionDistance {
  let sum = 0;
  let max = 0;
  let same = 0;
  for (let t = 0; t < reference.length; t++) {
    const p = logSoftmax(reference[t]!);
    const q = logSoftmax(test[t]!);
    let kl = 0;
    for (let i = 0; i < p.length; i++) kl += Math.exp(p[i]!) * (p[i]! - q[i]!);
    sum += kl;
    max = Math.max(max, kl);
    if (argmax(p) === argmax(q)) same++;
  }
  return {
    meanKld: sum / reference.length,
    maxKld: max,
    top1: same / reference.length,
    positions: reference.length,
  };
}
