import { describe, expect, it } from "vitest";
import { tinyModel } from "../../test/fixtures.ts";
import { jsKernels } from "../kernels/js.ts";
import { catalogModelDir } from "../model/catalog.ts";
import {
  adapterToFiles,
  createLoraAdapter,
  type LoraAdapter,
  loraParameters,
} from "../model/lora.ts";
import { loadModel } from "../model/model.ts";
import { Rng } from "../model/rng.ts";
import { Engine } from "../serve/engine.ts";
import { LoraTrainer } from "./lora-train.ts";
import {
  type MicroRows,
  type RlSequence,
  rlObjective,
  type TrajectoryGroup,
  trainRlStep,
} from "./rl.ts";
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
        "num_trajectories_dropped",
        "num_trajectories_trained",
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
        // Rewards away from their mean: a trajectory at the mean has no advantage and is left out.
        trajectories: answers.map((answer, i) => ({
          reward: [0, 1, 3][i]!,
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
    const grad = (lossFn: "ppo" | "cispo", lp: number, cap?: number) => {
      const adapter = createLoraAdapter(model, { rank: 2 }, 1);
      const trainer = new LoraTrainer(model, adapter, { kernels: jsKernels });
      // Sampling logprob far below the current one → ratio ≫ 1 + ε on every content token.
      return trainRlStep(trainer, group(lp), 1e-2, {
        lossFn,
        ...(cap === undefined ? {} : { maxImportanceWeight: cap }),
      }).grad_norm;
    };
    // With ρ ≫ 1 + ε the positive advantage's tokens are clipped in ppo, and the negative one's
    // ρ·A is capped by max_negative_advantage_importance_sampling_weight: no gradient at all.
    // Without the cap ρ·A drives the negative tokens (as in ART's trainer). cispo keeps a
    // clipped-weight gradient either way.
    expect(grad("ppo", -50, 3)).toBe(0);
    expect(grad("ppo", -50)).toBeGreaterThan(0);
    expect(grad("cispo", -50, 3)).toBeGreaterThan(0);
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

describe("ART's experimental_config in the step", () => {
  const model = tinyModel(46);
  const answers = ["The cat sat.", "The dog", "Hello there!"];
  const tokensOf = (answer: string) => model.tokenizer.encode(answer, { special: true });
  /** A group of three answers with rewards away from their mean, each choice with `lp` per
   * content token (or none). */
  const group = (lp?: (i: number) => number): TrajectoryGroup[] => [
    {
      trajectories: answers.map((answer, i) => ({
        reward: [0, 1, 3][i]!,
        messages_and_choices: [
          { role: "user", content: "Hi" },
          // A logprob for each content token and the end of the turn.
          choice(answer, lp ? [...tokensOf(answer), 0].map((_, k) => lp(i * 7 + k)) : undefined),
        ],
      })),
    },
  ];
  const run = (
    groups: TrajectoryGroup[],
    config: Parameters<typeof trainRlStep>[3],
    adapter?: LoraAdapter,
  ) => {
    const a = adapter ?? createLoraAdapter(model, { rank: 2 }, 1);
    const trainer = new LoraTrainer(model, a, { kernels: jsKernels });
    const m = trainRlStep(trainer, groups, 1e-2, config);
    return { m, bytes: adapterToFiles(a)["adapter_model.safetensors"] };
  };

  it("when ρ couples a sequence's tokens (sequence, average, geometric levels), then ppo's gradient is the loss's derivative", () => {
    const rng = new Rng(5);
    const T = 6;
    const mask = Float32Array.from([1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0]);
    const rows: MicroRows = {
      T,
      micro: [
        {
          tokens: [],
          weights: new Uint8Array(),
          old: new Float32Array(),
          advantage: 1.3,
          weight: 0.8,
          trainable: 4,
        },
        {
          tokens: [],
          weights: new Uint8Array(),
          old: new Float32Array(),
          advantage: -0.7,
          weight: 1.2,
          trainable: 3,
        },
      ] as RlSequence[],
      sampled: Float32Array.from({ length: 12 }, () => -1 - rng.next()),
      reference: null,
    };
    const logprobs = Float32Array.from({ length: 12 }, () => -1 - rng.next());
    for (const level of ["token", "sequence", "average", "geometric_average"] as const) {
      const objective = rlObjective(
        { lossFn: "ppo", epsilon: 0.5, importanceSamplingLevel: level },
        2,
      );
      const { grad } = objective(logprobs, mask, rows);
      for (let r = 0; r < 12; r++) {
        if (mask[r] === 0) continue;
        const at = (delta: number) => {
          const moved = Float64Array.from(logprobs);
          moved[r]! += delta;
          return objective(Float32Array.from(moved), mask, rows).loss;
        };
        const numeric = (at(1e-3) - at(-1e-3)) / 2e-3;
        expect(Math.abs(numeric - grad[r]!), `${level} at ${r}`).toBeLessThan(2e-3);
      }
    }
  });

  it("when the sampling logprobs are the policy's own, then every importance-sampling level gives pg's update", () => {
    const probe = new LoraTrainer(model, createLoraAdapter(model, { rank: 2 }, 1), {
      kernels: jsKernels,
    });
    const own = answers.map((answer) => {
      const chat = model.chat.trainingTokens(
        [
          toChatMessage({ role: "user", content: "Hi" }, "u"),
          toChatMessage({ role: "assistant", content: answer }, "a"),
        ],
        (i) => i === 1,
      );
      const lp = probe.evaluate(
        packBatch([{ tokens: chat.tokens, weights: chat.mask }], 256),
      ).tokenLogprobs;
      const out: number[] = [];
      for (let t = 1; t < chat.tokens.length; t++) if (chat.mask[t]) out.push(lp[t - 1]!);
      return out.slice(0, -1);
    });
    const groups: TrajectoryGroup[] = [
      {
        trajectories: answers.map((answer, i) => ({
          reward: [0, 1, 3][i]!,
          messages_and_choices: [{ role: "user", content: "Hi" }, choice(answer, own[i])],
        })),
      },
    ];
    const pg = run(groups, { lossFn: "pg" }).bytes;
    for (const level of ["token", "sequence", "average", "geometric_average"] as const) {
      const ppo = run(groups, { lossFn: "ppo", importanceSamplingLevel: level }).bytes;
      const got = new Float32Array(ppo!.buffer.slice(ppo!.byteOffset));
      const want = new Float32Array(pg!.buffer.slice(pg!.byteOffset));
      let worst = 0;
      for (let i = 0; i < want.length; i++) worst = Math.max(worst, Math.abs(got[i]! - want[i]!));
      expect(worst, level).toBeLessThan(1e-6);
    }
  });

  it("when allow_training_without_logprobs is false, then choices without logprobs are dropped; true trains plain assistant messages too", () => {
    const dropped = run(group(), { allowTrainingWithoutLogprobs: false });
    expect(dropped.m).toMatchObject({
      num_trajectories_dropped: 3,
      num_trajectories_trained: 0,
      grad_norm: 0,
    });
    expect(dropped.bytes).toEqual(run([{ trajectories: [] }], {}).bytes);
    const unset = run(group(), {});
    expect(unset.m.num_trajectories_trained).toBe(3);
    const withDict: TrajectoryGroup[] = [
      {
        trajectories: answers.map((answer, i) => ({
          reward: [0, 1, 3][i]!,
          messages_and_choices: [
            { role: "user", content: "Hi" },
            { role: "assistant", content: "The mat." },
            { role: "user", content: "Again" },
            choice(answer),
          ],
        })),
      },
    ];
    const context = run(withDict, {}).m.num_trainable_tokens;
    const trained = run(withDict, { allowTrainingWithoutLogprobs: true }).m.num_trainable_tokens;
    expect(trained).toBe(context + 3 * (tokensOf("The mat.").length + 1));
  });

  it("when precalculate_logprobs is set, then stale sampling logprobs leave ρ = 1 (pg's update) and only weight truncated importance sampling", () => {
    const stale = group(() => -50);
    const pg = run(stale, { lossFn: "pg" });
    expect(run(stale, { lossFn: "ppo", precalculateLogprobs: true }).bytes).toEqual(pg.bytes);
    // π_learner/π_sampling ≫ 2 on every token: each token's loss doubles, and so the gradient.
    const tis = run(stale, {
      lossFn: "pg",
      precalculateLogprobs: true,
      truncatedImportanceSampling: 2,
    });
    expect(tis.m.grad_norm / pg.m.grad_norm).toBeCloseTo(2, 4);
  });

  it("when mask_prob_ratio is set and every ρ is far outside the clip range, then nothing is trained", () => {
    const stale = group(() => -50);
    expect(run(stale, { lossFn: "ppo", maskProbRatio: true, epsilon: 0.2 }).m.grad_norm).toBe(0);
    expect(run(stale, { lossFn: "cispo", maskProbRatio: true }).m.grad_norm).toBe(0);
  });

  it("when a KL penalty is set, then it is measured against the base model: zero for a fresh adapter, shaping the update once the adapter moved", () => {
    const fresh = run(group(), { lossFn: "pg", klPenaltyCoef: 0.5 });
    expect(fresh.m.kl_policy_ref).toBe(0);
    expect(fresh.bytes).toEqual(run(group(), { lossFn: "pg" }).bytes);
    const moved = () => {
      const adapter = createLoraAdapter(model, { rank: 2 }, 1);
      const rng = new Rng(9);
      for (const p of loraParameters(adapter))
        for (let i = 0; i < p.data.length; i++) p.data[i] = 0.05 * rng.normal();
      return adapter;
    };
    const shaped = run(group(), { lossFn: "pg", klPenaltyCoef: 5 }, moved());
    expect(Math.abs(shaped.m.kl_policy_ref!)).toBeGreaterThan(1e-4);
    expect(shaped.bytes).not.toEqual(run(group(), { lossFn: "pg" }, moved()).bytes);
  });
});
