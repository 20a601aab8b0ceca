import { describe, expect, it } from "vitest";
import { Rng } from "../model/rng.ts";
import { applyRepetitionPenalty, logSoftmax, sampleToken } from "./sampling.ts";

const logprobs = logSoftmax(Float32Array.from([2, 1.9, 0.5, -1, -3]), null);
const draws = (options: Parameters<typeof sampleToken>[1], n = 400) => {
  const rng = new Rng(5);
  const seen = new Set<number>();
  for (let i = 0; i < n; i++) seen.add(sampleToken(logprobs, options, rng));
  return [...seen].sort();
};

describe("sampleToken", () => {
  it("when top_k is 2, then only the two most likely tokens are ever drawn", () => {
    expect(draws({ temperature: 1, topP: 1 }).length).toBeGreaterThan(3);
    expect(draws({ temperature: 1, topP: 1, topK: 2 })).toEqual([0, 1]);
  });

  it("when min_p is set, then tokens under min_p × the best's probability are never drawn", () => {
    // p(2)/p(0) = e^-1.5 ≈ 0.22, p(3)/p(0) ≈ 0.05.
    expect(draws({ temperature: 1, topP: 1, minP: 0.1 })).toEqual([0, 1, 2]);
    expect(draws({ temperature: 1, topP: 1, topK: 4, minP: 0.1 })).toEqual([0, 1, 2]);
  });

  it("when top_p and top_k combine, then the nucleus is taken within the top k", () => {
    expect(draws({ temperature: 1, topP: 0.5, topK: 3 })).toEqual([0, 1]);
  });
});

describe("applyRepetitionPenalty", () => {
  it("when a token was seen, then a positive logit is divided and a negative one multiplied", () => {
    const logits = Float32Array.from([2, -2, 1]);
    applyRepetitionPenalty(logits, new Set([0, 1]), 2);
    expect(Array.from(logits)).toEqual([1, -4, 1]);
  });
});
