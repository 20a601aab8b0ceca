import type { Rng } from "../model/rng.ts";

export interface TopLogprob {
  token: number;
  logprob: number;
}

/** OpenAI-style penalties: logit −= presence·[count>0] + frequency·count. */
export function applyPenalties(
  logits: Float32Array,
  counts: Map<number, number>,
  presence: number,
  frequency: number,
): void {
  if (presence === 0 && frequency === 0) return;
  for (const [token, count] of counts) {
    logits[token] = logits[token]! - presence - frequency * count;
  }
}

/** Hugging Face's repetition penalty: a seen token's logit is divided by `penalty` when positive
 * and multiplied by it when negative. */
export function applyRepetitionPenalty(
  logits: Float32Array,
  seen: ReadonlySet<number>,
  penalty: number,
): void {
  if (penalty === 1) return;
  for (const token of seen) {
    const logit = logits[token]!;
    logits[token] = logit > 0 ? logit / penalty : logit * penalty;
  }
}

/** log-softmax over the allowed tokens (masked ones get −∞). */
export function logSoftmax(logits: Float32Array, allowed: Uint8Array | null): Float64Array {
  const out = new Float64Array(logits.length);
  let max = Number.NEGATIVE_INFINITY;
  for (let i = 0; i < logits.length; i++) {
    if (allowed && !allowed[i]) continue;
    if (logits[i]! > max) max = logits[i]!;
  }
  let sum = 0;
  for (let i = 0; i < logits.length; i++) {
    if (allowed && !allowed[i]) continue;
    sum += Math.exp(logits[i]! - max);
  }
  const lse = max + Math.log(sum);
  for (let i = 0; i < logits.length; i++) {
    out[i] = allowed && !allowed[i] ? Number.NEGATIVE_INFINITY : logits[i]! - lse;
  }
  return out;
}

export function topLogprobs(logprobs: Float64Array, k: number): TopLogprob[] {
  const best: TopLogprob[] = [];
  if (k <= 0) return best;
  for (let i = 0; i < logprobs.length; i++) {
    const logprob = logprobs[i]!;
    if (logprob === Number.NEGATIVE_INFINITY) continue;
    if (best.length < k || logprob > best[best.length - 1]!.logprob) {
      best.push({ token: i, logprob });
      best.sort((a, b) => b.logprob - a.logprob || a.token - b.token);
      if (best.length > k) best.pop();
    }
  }
  return best;
}

export interface SamplingOptions {
  temperature: number;
  topP: number;
  /** Keep the k most likely tokens (0: all). */
  topK?: number;
  /** Keep tokens at least `minP` × the most likely one's probability (0: all). */
  minP?: number;
}

/**
 * Picks a token: greedy when temperature is 0; otherwise samples from softmax(logits/T), cut as
 * Hugging Face cuts it, in its order: the top-k tokens, then the top-p nucleus, then those at
 * least min-p × the best. Without a cut the draw walks the weights in token order, O(V) with no
 * allocation per candidate; a cut ranks by weight (ties by token id). Either way the same seed
 * always gives the same token.
 */
export function sampleToken(logprobs: Float64Array, options: SamplingOptions, rng: Rng): number {
  let best = -1;
  for (let i = 0; i < logprobs.length; i++) {
    if (logprobs[i] === Number.NEGATIVE_INFINITY) continue;
    if (best < 0 || logprobs[i]! > logprobs[best]!) best = i;
  }
  if (best < 0) throw new Error("sampling: every token is masked");
  if (options.temperature <= 0) return best;
  const top = logprobs[best]!;
  const minP = options.minP ?? 0;
  const topK = options.topK ?? 0;
  const ranked = options.topP < 1 || topK > 0;
  const weights = new Float64Array(logprobs.length);
  let total = 0;
  let candidates = 0;
  for (let i = 0; i < logprobs.length; i++) {
    const lp = logprobs[i]!;
    if (lp === Number.NEGATIVE_INFINITY) continue;
    // Relative to the best token, which is min-p's ratio; with no other cut min-p applies here.
    const weight = Math.exp((lp - top) / options.temperature);
    if (!ranked && weight < minP) continue;
    weights[i] = weight;
    total += weight;
    if (weight > 0) candidates++;
  }
  if (!ranked) {
    let r = rng.next() * total;
    let last = best;
    for (let i = 0; i < weights.length; i++) {
      const weight = weights[i]!;
      if (weight === 0) continue;
      last = i;
      r -= weight;
      if (r <= 0) return i;
    }
    return last;
  }
  const order = new Uint32Array(candidates);
  for (let i = 0, k = 0; i < weights.length; i++) if (weights[i]! > 0) order[k++] = i;
  order.sort((a, b) => weights[b]! - weights[a]! || a - b);
  let kept = topK > 0 ? Math.min(topK, order.length) : order.length;
  let keptMass = 0;
  for (let i = 0; i < kept; i++) keptMass += weights[order[i]!]!;
  if (options.topP < 1) {
    let cumulative = 0;
    for (let i = 0; i < kept; i++) {
      cumulative += weights[order[i]!]! / keptMass;
      if (cumulative >= options.topP) {
        kept = i + 1;
        break;
      }
    }
  }
  // Min-p last: the kept tokens are sorted, so those it keeps are a prefix (the best stays).
  while (kept > 1 && weights[order[kept - 1]!]! < minP) kept--;
  let keptTotal = 0;
  for (let i = 0; i < kept; i++) keptTotal += weights[order[i]!]!;
  let r = rng.next() * keptTotal;
  for (let i = 0; i < kept; i++) {
    r -= weights[order[i]!]!;
    if (r <= 0) return order[i]!;
  }
  return order[kept - 1]!;
}
