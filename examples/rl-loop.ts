/**
 * RL loop: sample answers with logprobs, score them with a reward function, submit the groups
 * as a training step, repeat; the mean reward on fresh samples rises.
 *
 *   ./scripts/serve &   then   node examples/rl-loop.ts
 */
import type { ArborClient } from "@arbor/client";
import { connect } from "./connect.ts";

export const words = ["apple", "horse", "table", "lemon", "green", "clock", "mouse", "peach"];

/** The verifiable reward: 1 for exactly the uppercased word. */
export function reward(word: string, answer: string): number {
  return answer.trim() === word.toUpperCase() ? 1 : 0;
}

export const question = (word: string) => `Uppercase the word ${word}.`;

/** The mean reward of `samples` fresh answers (temperature 1, fixed seeds) of `model`. */
export async function meanReward(
  client: ArborClient,
  model: string,
  samples: number,
): Promise<number> {
  const rewards = await Promise.all(
    Array.from({ length: samples }, async (_, i) => {
      const word = words[i % words.length]!;
      const c = await client.chat.completions.create({
        model,
        messages: [{ role: "user", content: question(word) }],
        max_tokens: 16,
        temperature: 1,
        seed: 10_000 + i,
      });
      return reward(word, c.choices[0]!.message.content ?? "");
    }),
  );
  return rewards.reduce((a, b) => a + b, 0) / rewards.length;
}

export interface RlLoopResult {
  before: number;
  after: number;
  rewards: number[];
}

export async function runRlLoop(
  client: ArborClient,
  options: { steps?: number; groups?: number; samples?: number } = {},
  log: (line: string) => void = console.log,
): Promise<RlLoopResult> {
  const steps = options.steps ?? 30;
  const groupsPerStep = options.groups ?? 12;
  const model = await client.training.models.create({
    project: "examples",
    name: `uppercase-${Date.now()}`,
    base_model: "arbor/tiny-chat",
  });
  const alias = `${model.entity}/${model.project}/${model.name}`;
  const before = await meanReward(client, alias, options.samples ?? 128);
  log(`mean reward before: ${before.toFixed(3)}`);
  const rewards: number[] = [];
  for (let step = 0; step < steps; step++) {
    const groups = await Promise.all(
      Array.from({ length: groupsPerStep }, async (_, g) => {
        const word = words[(step * groupsPerStep + g) % words.length]!;
        const messages = [{ role: "user" as const, content: question(word) }];
        const sampled = await client.chat.completions.create({
          model: alias,
          messages,
          n: 6,
          max_tokens: 16,
          temperature: 1,
          logprobs: true,
          seed: step * 100 + g,
        });
        return {
          trajectories: sampled.choices.map((choice) => ({
            messages_and_choices: [...messages, choice],
            reward: reward(word, choice.message.content ?? ""),
          })),
        };
      }),
    );
    const all = groups.flatMap((g) => g.trajectories.map((t) => t.reward));
    rewards.push(all.reduce((a, b) => a + b, 0) / all.length);
    const job = await client.training.jobs.createRl({
      model_id: model.id,
      trajectory_groups: groups as never,
      experimental_config: { learning_rate: 1e-3, loss_fn: "ppo" },
    });
    for await (const event of client.training.jobs.events.follow(job.id)) {
      if (event.type === "training_failed")
        throw new Error(`step ${step} failed: ${String(event.data.error_message)}`);
    }
    log(`step ${step + 1}/${steps}: sampled reward ${rewards.at(-1)!.toFixed(3)}`);
  }
  const after = await meanReward(client, alias, options.samples ?? 128);
  log(`mean reward after:  ${after.toFixed(3)} (before ${before.toFixed(3)})`);
  return { before, after, rewards };
}

if (import.meta.main) await runRlLoop(connect());
