import { spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";
import { lossObjective, type Matrix, type WireLoss } from "../src/runs/token-matrix.ts";

/**
 * Tinker's five losses (ADR 71) as the runs compute them (`lossObjective`: the loss and its
 * gradient by the log-probs), against PyTorch's autograd of the documented formulas
 * (test/tinker_loss_reference.py, Debian's python3-torch). Without torch the cases skip, saying
 * why; under CI they fail.
 */
const torchFound = spawnSync("/usr/bin/python3", ["-c", "import torch"]).status === 0;
const runTorch = torchFound || process.env.CI === "true";
if (!runTorch)
  console.log(
    "tinker-losses: PyTorch not found (/usr/bin/python3 -c 'import torch'): skipped; apt-get install python3-torch",
  );

interface Case {
  loss: WireLoss["name"];
  lp: number[];
  q: number[];
  A: number[];
  w: number[];
  config: Record<string, number>;
}

function reference(cases: Case[]): { loss: number; grad: number[] }[] {
  const script = fileURLToPath(new URL("./tinker_loss_reference.py", import.meta.url));
  const result = spawnSync("/usr/bin/python3", [script], {
    input: JSON.stringify({ cases }),
    encoding: "utf8",
    env: { ...process.env, OMP_NUM_THREADS: "1" },
  });
  if (result.status !== 0) throw new Error(`tinker_loss_reference.py failed: ${result.stderr}`);
  return JSON.parse(result.stdout);
}

/** A deterministic stream in [0, 1). */
function stream(seed: number): () => number {
  let s = seed >>> 0;
  return () => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return s / 2 ** 32;
  };
}

/** One datum of `n` positions: learner log-probs near the sampler's, so that ratios fall on both
 * sides of every clip threshold; a prompt of zero advantages first. */
function makeCase(loss: WireLoss["name"], seed: number, config: Record<string, number>): Case {
  const rand = stream(seed);
  const n = 24;
  const q = Array.from({ length: n }, () => -0.2 - 3 * rand());
  const lp = q.map((v) => Math.min(-1e-3, v + (rand() - 0.5) * 1.6));
  const prompt = 5;
  const A = Array.from({ length: n }, (_, i) => (i < prompt ? 0 : (rand() - 0.5) * 4));
  const w =
    loss === "cross_entropy"
      ? Array.from({ length: n }, (_, i) => (i < prompt ? 0 : (rand() - 0.3) * 2))
      : Array.from({ length: n }, () => 1);
  return { loss, lp, q, A, w, config };
}

/** The case as the matrix the runs decode from a Tinker datum (one target per position). */
function matrixOf(c: Case): Matrix {
  const T = c.lp.length;
  const policy = c.loss !== "cross_entropy";
  const decisive = policy ? c.A : c.w;
  const active = Uint8Array.from(decisive, (v) => (v !== 0 ? 1 : 0));
  return {
    id: "datum-0",
    T,
    K: 1,
    tokens: new Int32Array(T),
    targets: new Int32Array(T),
    weights: Float32Array.from(c.w),
    advantages: policy ? Float32Array.from(c.A) : null,
    behavior: policy ? Float32Array.from(c.q) : null,
    policyVersions: null,
    active,
    activeCount: active.reduce((a, b) => a + b, 0),
  };
}

const CASES: [WireLoss["name"], Record<string, number>][] = [
  ["cross_entropy", {}],
  ["importance_sampling", {}],
  ["ppo", {}],
  ["ppo", { clip_low_threshold: 0.9, clip_high_threshold: 1.1 }],
  ["cispo", {}],
  ["cispo", { clip_low_threshold: 0.7, clip_high_threshold: 1.3 }],
  ["dro", {}],
  ["dro", { beta: 0.5 }],
];

describe("Tinker's losses against PyTorch", () => {
  it.skipIf(!runTorch)(
    "when each loss is computed on datums whose ratios straddle the clip thresholds, then its sum and its gradient by the log-probs are PyTorch's",
    () => {
      const cases = CASES.flatMap(([loss, config], i) =>
        [1, 2, 3].map((s) => makeCase(loss, 97 * i + s, config)),
      );
      const expected = reference(cases);
      cases.forEach((c, i) => {
        const m = matrixOf(c);
        // The inputs as the runs hold them: float32.
        const lp = Float32Array.from(c.lp);
        const wire: WireLoss = {
          name: c.loss,
          normalize_advantages: false,
          reduction: "sum",
          ...c.config,
        };
        const { loss, grad } = lossObjective(m, wire, 0, 1)(lp);
        const ref = expected[i]!;
        expect(loss, `${c.loss} ${JSON.stringify(c.config)}`).toBeCloseTo(ref.loss, 4);
        ref.grad.forEach((g, p) => {
          expect(grad[p], `${c.loss} position ${p}`).toBeCloseTo(g, 4);
        });
      });
      // The clamps were exercised: some ratio of a PPO case is outside [0.8, 1.2].
      const ppo = cases.find((c) => c.loss === "ppo")!;
      const ratios = ppo.lp.map((v, p) => Math.exp(v - ppo.q[p]!));
      expect(ratios.some((r) => r < 0.8)).toBe(true);
      expect(ratios.some((r) => r > 1.2)).toBe(true);
    },
  );
});
