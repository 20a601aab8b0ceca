import { describe, expect, it } from "vitest";
import { tinyModel } from "../test/fixtures.ts";
import { catalogModelDir } from "./catalog.ts";
import { Engine } from "./engine.ts";
import { jsKernels } from "./kernels/js.ts";
import { adapterToFiles, createLoraAdapter, type LoraAdapter, loraParameters } from "./lora.ts";
import { LoraTrainer } from "./lora-train.ts";
import { loadModel } from "./model.ts";
import { type TrajectoryGroup, trainRlStep } from "./rl.ts";
import { Rng } from "./rng.ts";
import { packBatch } from "./sft.ts";
import { TrainingInputError, toChatMessage } from "./training-data.ts";

const choice = (content: string, logprobs?: number[]) => ({
  index: 0,
  finish_reason: "stop",
  message: { role: "assistant", content },
  ...(logprobs ? { logprobs: { content: logprobs.map((logprob) => ({ logprob })) } } : {}),
});

const traj = (answer: string, reward: number) => ({
  reward,
  messages_and_choices: [{ role: "user", content: "Hello there!" }, choice(answer)],
  extra_key: "ignored",
});

describe("trainRlStep", () => {
  it("when input is bad, then a TrainingInputError names the group and trajectory", () => {
    const model = tinyModel(41);
    const trainer = new LoraTrainer(model, createLoraAdapter(model), { kernels: jsKernels });
    expect(() => trainRlStep(trainer, [], 1e-3)).toThrow(TrainingInputError);
    expect(() => trainRlStep(trainer, [], 1e-3)).toThrow(/no trajectory groups/);
    const noChoice: TrajectoryGroup = {
      trajectories: [
        traj("The cat", 1),
        { reward: 0, messages_and_choices: [{ role: "user", content: "x" }] },
      ],
    };
    expect(() => trainRlStep(trainer, [noChoice], 1e-3)).toThrow(
      /group 0 trajectory 1: no trainable assistant turn/,
    );
    const badReward = {
      trajectories: [traj("a", 1), { ...traj("b", 0), reward: "high" }],
    } as unknown as TrajectoryGroup;
    expect(() => trainRlStep(trainer, [{ trajectories: [traj("a", 1)] }, badReward], 1e-3)).toThrow(
      /group 1 trajectory 1: reward must be a finite number/,
    );
  });

  it("when groups have equal rewards, then they are skipped and counted, and metrics are complete", () => {
    const model = tinyModel(42);
    const adapter = createLoraAdapter(model, { rank: 2 }, 1);
    const trainer = new LoraTrainer(model, adapter, { kernels: jsKernels });
    const before = adapterToFiles(adapter)["adapter_model.safetensors"];
    const flat = { trajectories: [traj("The cat", 1), traj("The dog", 1)] };
    const m0 = trainRlStep(trainer, [flat], 1e-2);
    expect(m0.num_groups_skipped).toBe(1);
    expect(m0.num_groups_trainable).toBe(0);
    expect(m0.num_trainable_tokens).toBe(0);
    expect(adapterToFiles(adapter)["adapter_model.safetensors"]).toEqual(before);
    const useful = { trajectories: [traj("The cat sat.", 1), traj("The dog", 0)] };
    const m = trainRlStep(trainer, [flat, useful], 1e-2, { lossFn: "pg" });
    expect(m).toMatchObject({
      num_groups_skipped: 1,
      num_groups_trainable: 1,
      reward: 0.75,
      reward_std_dev: 0.25,
      learning_rate: 1e-2,
      gradient_step: 1,
    });
    expect(Object.keys(m).sort()).toEqual(
      [
        "entropy",
        "grad_norm",
        "gradient_step",
        "learning_rate",
        "loss",
        "num_groups_skipped",
        "num_groups_trainable",
        "num_tokens",
        "num_trainable_tokens",
        "reward",
        "reward_std_dev",
        "tokens_per_second",
      ].sort(),
    );
    expect(m.entropy).toBeGreaterThan(0);
    expect(m.grad_norm).toBeGreaterThan(0);
    expect(m.num_tokens).toBeGreaterThan(m.num_trainable_tokens);
  });

  it("when turns carry no sampling logprobs, then ppo and cispo fall back to pg (the same update)", () => {
    const model = tinyModel(43);
    const groups: TrajectoryGroup[] = [
      { trajectories: [traj("The cat sat.", 1), traj("The dog", 0), traj("The log", 0.5)] },
    ];
    const run = (lossFn: "ppo" | "cispo" | "pg") => {
      const adapter = createLoraAdapter(model, { rank: 2 }, 1);
      const trainer = new LoraTrainer(model, adapter, { kernels: jsKernels });
      trainRlStep(trainer, groups, 1e-2, { lossFn });
      return adapterToFiles(adapter)["adapter_model.safetensors"];
    };
    const pg = run("pg");
    expect(run("pg")).toEqual(pg); // deterministic
    expect(run("ppo")).toEqual(pg);
    expect(run("cispo")).toEqual(pg);
  });

  it("when the sampling logprobs equal the current policy's, then ppo and cispo equal pg, and context turns are not trained", () => {
    const model = tinyModel(45, { maxPositions: 256 });
    const messagesOf = (answer: string) => [
      { role: "system", content: "Be short." },
      { role: "user", content: "Hi" },
      { role: "assistant", content: "The cat sat." },
      { role: "user", content: "And?" },
      { role: "assistant", content: answer },
    ];
    const answers = ["The dog sat on the log.", "Hello there!", "The mat."];
    // The current policy's log-probs of each answer's content tokens, as a sampler would report.
    const probe = new LoraTrainer(model, createLoraAdapter(model, { rank: 2 }, 1), {
      kernels: jsKernels,
    });
    const sampled = answers.map((answer) => {
      const chat = model.chat.trainingTokens(
        messagesOf(answer).map((m, i) => toChatMessage(m, `m${i}`)),
        (i) => i === 4,
      );
      const lp = probe.evaluate(
        packBatch([{ tokens: chat.tokens, weights: chat.mask }], 256),
      ).tokenLogprobs;
      const out: number[] = [];
      for (let t = 1; t < chat.tokens.length; t++) if (chat.mask[t]) out.push(lp[t - 1]!);
      return out.slice(0, -1); // without <|im_end|>
    });
    const groupsOf = (logprobs: number[][]): TrajectoryGroup[] => [
      {
        trajectories: answers.map((answer, i) => ({
          reward: i,
          messages_and_choices: [...messagesOf(answer).slice(0, 4), choice(answer, logprobs[i])],
        })),
      },
    ];
    const run = (lossFn: "ppo" | "cispo" | "pg", logprobs = sampled) => {
      const adapter = createLoraAdapter(model, { rank: 2 }, 1);
      const trainer = new LoraTrainer(model, adapter, { kernels: jsKernels });
      const m = trainRlStep(trainer, groupsOf(logprobs), 1e-2, { lossFn });
      return { m, bytes: adapterToFiles(adapter)["adapter_model.safetensors"] };
    };
    const pg = run("pg");
    expect(run("ppo").bytes).toEqual(pg.bytes);
    expect(run("cispo").bytes).toEqual(pg.bytes);
    // The content-only logprobs are really used (not dropped to the pg fallback): far-off
    // sampling logprobs clip ppo's content tokens, so its update differs from pg's.
    const stale = sampled.map((lp) => lp.map(() => -50));
    expect(run("ppo", stale).bytes).not.toEqual(pg.bytes);
    // Only the choices are trained: content tokens plus <|im_end|> each.
    const expected = sampled.reduce((n, s) => n + s.length + 1, 0);
    expect(pg.m.num_trainable_tokens).toBe(expected);
  });

  it("when sampling logprobs make the ratio leave the clip range, then ppo stops the gradient and cispo does not", () => {
    const model = tinyModel(44);
    const group = (lp: number): TrajectoryGroup[] => [
      {
        trajectories: ["The cat sat.", "The dog"].map((answer, i) => ({
          reward: 1 - i,
          messages_and_choices: [
            { role: "user", content: "Hi" },
            // One logprob per content token plus one for <|im_end|>.
            choice(
              answer,
              [...model.tokenizer.encode(answer, { special: true }), 0].map(() => lp),
            ),
          ],
        })),
      },
    ];
    const grad = (lossFn: "ppo" | "cispo", lp: number) => {
      const adapter = createLoraAdapter(model, { rank: 2 }, 1);
      const trainer = new LoraTrainer(model, adapter, { kernels: jsKernels });
      // Sampling logprob far below the current one → ratio ≫ 1 + ε on every content token.
      return trainRlStep(trainer, group(lp), 1e-2, { lossFn }).grad_norm;
    };
    // With ρ ≫ 1 + ε every token is clipped in ppo (positive advantages by the ε clip, negative
    // ones by the dual clip): no gradient. cispo keeps a clipped-weight gradient.
    expect(grad("ppo", -50)).toBe(0);
    expect(grad("cispo", -50)).toBeGreaterThan(0);
    // Near ρ = 1 ppo does train.
    expect(grad("ppo", -5)).toBeGreaterThan(0);
  });
});

describe("RL on the shipped model", () => {
  it("when trained on sampled groups with a correctness reward, then the mean reward on fresh samples rises", async () => {
    const model = await loadModel(catalogModelDir("arbor/tiny-chat"));
    const engine = new Engine(model);
    const adapter = createLoraAdapter(model, { rank: 8, alpha: 16 }, 1);
    const trainer = new LoraTrainer(model, adapter);
    // Uppercasing a word: in the pretraining domain, but sampled answers are often wrong.
    const words = ["apple", "horse", "table", "lemon", "green", "clock", "mouse", "peach"];
    const task = (rng: Rng): [string, (text: string) => number] => {
      const word = rng.pick(words);
      return [`Uppercase the word ${word}.`, (t) => (t.trim() === word.toUpperCase() ? 1 : 0)];
    };
    const meanReward = async (current: LoraAdapter) => {
      const rng = new Rng(1000);
      const rewards = await Promise.all(
        Array.from({ length: 128 }, (_, i) => {
          const [q, reward] = task(rng);
          return engine
            .complete({
              messages: [{ role: "user", content: q }],
              temperature: 1,
              seed: 1000 + i,
              maxTokens: 16,
              adapter: current,
            })
            .then((c) => reward(c.choices[0]!.text));
        }),
      );
      return rewards.reduce((a, b) => a + b, 0) / rewards.length;
    };
    const before = await meanReward(adapter);
    for (let step = 0; step < 30; step++) {
      const rng = new Rng(step + 1);
      const groups = await Promise.all(
        Array.from({ length: 12 }, async (_, g): Promise<TrajectoryGroup> => {
          const [q, reward] = task(rng);
          const c = await engine.complete({
            messages: [{ role: "user", content: q }],
            temperature: 1,
            seed: step * 100 + g,
            n: 6,
            maxTokens: 16,
            logprobs: true,
            adapter,
          });
          return {
            trajectories: c.choices.map((ch) => ({
              reward: reward(ch.text),
              messages_and_choices: [
                { role: "user", content: q },
                choice(
                  ch.text,
                  ch.logprobs!.map((l) => l.logprob),
                ),
              ],
            })),
          };
        }),
      );
      trainRlStep(trainer, groups, 1e-3, { lossFn: "ppo" });
    }
    const after = await meanReward(adapter);
    expect(loraParameters(adapter).some((p) => p.data.some((x) => x !== 0))).toBe(true);
    console.log(`RL learning: mean reward ${before} → ${after}`);
    expect(before).toBeLessThan(0.7);
    expect(after).toBeGreaterThanOrEqual(before + 0.2);
  });
});
