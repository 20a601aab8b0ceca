import type { Rng } from "./rng.ts";

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

/**
 * Picks a token: greedy when temperature is 0, otherwise samples from softmax(logits/T)
 * restricted to the top-p nucleus. Ties and order are resolved by token id, so the same
 * seed always gives the same token.
 */
export function sampleToken(
  logprobs: Float64Array,
  options: { temperature: number; topP: number },
  rng: Rng,
): number {
  let best = -1;
  for (let i = 0; i < logprobs.length; i++) {
    if (logprobs[i] === Number.NEGATIVE_INFINITY) continue;
    if (best < 0 || logprobs[i]! > logprobs[best]!) best = i;
  }
  if (best < 0) throw new Error("sampling: every token is masked");
  if (options.temperature <= 0) return best;
  const candidates: { token: number; weight: number }[] = [];
  const top = logprobs[best]!;
  for (let i = 0; i < logprobs.length; i++) {
    const lp = logprobs[i]!;
    if (lp === Number.NEGATIVE_INFINITY) continue;
    const weight = Math.exp((lp - top) / options.temperature);
    if (weight > 0) candidates.push({ token: i, weight });
  }
  candidates.sort((a, b) => b.weight - a.weight || a.token - b.token);
  let total = 0;
  for (const c of candidates) total += c.weight;
  let kept = candidates.length;
  if (options.topP < 1) {
    let cumulative = 0;
    for (let i = 0; i < candidates.length; i++) {
      cumulative += candidates[i]!.weight / total;
      if (cumulative >= options.topP) {
        kept = i + 1;
        break;
      }
    }
  }
  let keptTotal = 0;
  for (let i = 0; i < kept; i++) keptTotal += candidates[i]!.weight;
  let r = rng.next() * keptTotal;
  for (let i = 0; i < kept; i++) {
    r -= candidates[i]!.weight;
    if (r <= 0) return candidates[i]!.token;
  }
  return candidates[kept - 1]!.token;
}
