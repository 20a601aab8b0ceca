import type { ArborClient } from "@arbor/client";
import { meanReward, question, reward, words } from "@arbor/examples/rl-loop";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { adam, RunClient, TrainingRuns, wireLoss } from "./native-runs/client.ts";
import { BASE, requestId, SPEC, tinyModel } from "./native-runs/fixtures.ts";
import {
  type TokenizedRollout,
  tokenMatrixBatchFromArtRollouts,
} from "./native-runs/token-matrix.ts";

/**
 * examples/rl-loop.ts's task (uppercase a word, reward 1 for exactly the uppercased word, on
 * tiny-chat) learned through the native training API as ART's ServerlessBackend runs RL: each step
 * samples groups through POST /v1/chat/completions (n, logprobs, temperature 1) on the model's
 * latest, lowers the rollouts with ART's helpers, then CISPO forward_backward, optim_step and
 * save_weights_for_sampler into the model; the mean reward of fresh samples must rise as the
 * preview RL loop's does (examples.test.ts: below 0.7 before, 0.2 higher after, 128 samples).
 */
let server: RunningServer;
beforeAll(async () => {
  server = await startServer({}, { worker: true });
});
afterAll(() => server.close());

const STEPS = 30;
const GROUPS = 12;
const SAMPLES = 128;

/** A sampled reply as ART tokenizes it: the template's tokens, the sampler's log-prob at each of
 * the reply's tokens. The sampler reports none for the end-of-turn token it stopped on, which the
 * loss needs (the preview takes ρ = 1 there): it is given log-prob 0, so its ratio is π itself.
 * Null when the reply does not re-tokenize to as many tokens as were sampled. */
async function tokenizeReply(
  word: string,
  content: string,
  logprobs: readonly number[],
): Promise<Pick<TokenizedRollout, "tokenIds" | "assistantMask" | "logprobs"> | null> {
  const { chat } = await tinyModel();
  const { tokens, mask } = chat.trainingTokens(
    [
      { role: "user", content: question(word) },
      { role: "assistant", content },
    ],
    () => true,
  );
  const positions = tokens.flatMap((_, p) => (mask[p] ? [p] : []));
  if (logprobs.length !== positions.length && logprobs.length !== positions.length - 1) return null;
  const sampled = new Array<number>(tokens.length).fill(Number.NaN);
  positions.forEach((p, k) => {
    sampled[p] = logprobs[k] ?? 0;
  });
  return { tokenIds: tokens, assistantMask: Array.from(mask), logprobs: sampled };
}

/** One step's groups sampled from `model`, as ART's rollouts with group-relative advantages
 * (reward − mean over std); groups of equal rewards teach nothing and are left out. */
async function sampleRollouts(
  client: ArborClient,
  model: string,
  step: number,
): Promise<TokenizedRollout[]> {
  const groups = await Promise.all(
    Array.from({ length: GROUPS }, async (_, g) => {
      const word = words[(step * GROUPS + g) % words.length]!;
      const sampled = await client.chat.completions.create({
        model,
        messages: [{ role: "user", content: question(word) }],
        n: 6,
        max_tokens: 16,
        temperature: 1,
        logprobs: true,
        seed: step * 100 + g,
      });
      return Promise.all(
        sampled.choices.map(async (choice) => {
          const content = choice.message.content ?? "";
          const logprobs = (choice.logprobs?.content ?? []).map((c) => c.logprob);
          return {
            reward: reward(word, content),
            tokens: await tokenizeReply(word, content, logprobs),
          };
        }),
      );
    }),
  );
  const rollouts: TokenizedRollout[] = [];
  groups.forEach((group, promptId) => {
    const rewards = group.map((r) => r.reward);
    const mean = rewards.reduce((a, b) => a + b, 0) / rewards.length;
    const std = Math.sqrt(rewards.reduce((a, r) => a + (r - mean) ** 2, 0) / rewards.length);
    if (std === 0) return;
    for (const r of group)
      if (r.tokens)
        rollouts.push({
          ...r.tokens,
          advantage: (r.reward - mean) / (std + 1e-6),
          weight: 1,
          promptId,
        });
  });
  return rollouts;
}

describe("RL through the native training API", () => {
  it("when examples/rl-loop.ts's task is trained by cispo forward_backward + optim_step + save_weights_for_sampler, then the mean reward on fresh samples rises as the preview loop's does", async () => {
    const client = server.authorizedClient();
    const model = await client.training.models.create({
      project: "native-rl",
      name: `uppercase-${Date.now()}`,
      base_model: BASE,
    });
    const alias = `${model.entity}/${model.project}/${model.name}`;
    const run = await RunClient.resolve(new TrainingRuns(server.baseUrl, server.adminKey), {
      requestId: requestId("resolve"),
      spec: SPEC,
    });
    const before = await meanReward(client, alias, SAMPLES);
    for (let step = 0; step < STEPS; step++) {
      const rollouts = await sampleRollouts(client, alias, step);
      if (rollouts.length === 0) continue;
      const fb = await run.forwardBackward({
        requestId: requestId("fb"),
        batch: tokenMatrixBatchFromArtRollouts(rollouts),
        loss: wireLoss("cispo", { normalizeAdvantages: false, clipLow: 0, clipHigh: 5 }),
        returnTokenLogprobs: false,
      });
      const optim = await run.optimStep(
        requestId("optim"),
        adam(1e-3, { beta2: 0.999, eps: 1e-8, weight_decay: 0, grad_clip_norm: 1 }),
      );
      const publish = await run.saveWeightsForSampler({
        requestId: requestId("publish"),
        checkpointName: `step-${step + 1}`,
        modelAlias: alias,
      });
      await fb.result();
      await optim.result();
      await publish.result();
    }
    const after = await meanReward(client, alias, SAMPLES);
    console.log(
      `native RL loop: mean reward ${before.toFixed(3)} before, ${after.toFixed(3)} after`,
    );
    expect(before).toBeLessThan(0.7);
    expect(after).toBeGreaterThanOrEqual(before + 0.2);
  });
});
