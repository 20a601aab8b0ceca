import { createWasmKernels } from "@arbor/engine/kernels";
import {
  adapterFromFiles,
  catalogModelDir,
  type LoraAdapter,
  loadModel,
  loraParameters,
  type Model,
} from "@arbor/engine/model";
import {
  LoraTrainer,
  planSft,
  type SftExample,
  type TrajectoryGroup,
  trainRlStep,
  trainSft,
} from "@arbor/engine/train";
import { type Json, type OperationKind, openStore } from "@arbor/store";
import { afterAll, describe, expect, it } from "vitest";
import { readCheckpointFiles } from "../src/checkpoints.ts";
import { rlStepConfig } from "../src/jobs.ts";
import {
  freshAdapter,
  RunExecutor,
  type RunSpec,
  runFilesPrefix,
  type SafePoint,
} from "../src/runs/execute.ts";
import { sweepBlobs } from "../src/sweep.ts";

const BASE = "arbor/tiny-chat";
const store = await openStore({ dataDir: ":memory:" });
afterAll(() => store.close());

const chat = (q: string, a: string): SftExample => ({
  messages: [
    { role: "user", content: q },
    { role: "assistant", content: a },
  ],
});

/**
 * The native training API's execution (ADR 57) against the preview SFT job's: the same examples,
 * one per step, trained by `trainSft` and by cross-entropy forward_backward + optim_step with
 * loss weights 1/N (so the sum is the job's mean over its N trainable tokens) and the job's
 * AdamW settings, give the same adapter, bit for bit: the two run the same objective through
 * the same trainer on the same batch, and the run's learner and gradient go through F32 files.
 */
describe("RunExecutor", () => {
  it("when the same examples are trained by an SFT job and by forward_backward + optim_step, then the adapters are bitwise equal", async () => {
    const base = await loadModel(catalogModelDir(BASE));
    const examples = [chat("Reverse cat", "tac"), chat("Reverse dog", "god"), chat("Hi", "Hello.")];
    const lr = 1e-2;
    const spec: RunSpec & Record<string, Json> = {
      base_model: BASE,
      lora_rank: 4,
      lora_target_modules: [
        "down_proj",
        "gate_proj",
        "k_proj",
        "lm_head",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
      ],
      seed: 7,
    };
    await store.entities.ensure("e");
    const run = await store.trainingRuns.resolve({
      entity: "e",
      request_id: "resolve",
      fingerprint: "f",
      run_name: null,
      spec,
      initial: null,
    });
    const config = { batchSize: 1, epochs: 1, learningRate: lr, schedule: "constant" as const };
    const plan = planSft(base, examples, config);
    const kernels = createWasmKernels("auto", { threads: 1 });
    const job = await trainSft(base, examples, config, {
      plan,
      kernels,
      adapter: freshAdapter(base, spec, run.id),
    });

    const executor = new RunExecutor(store, base, kernels);
    const admit = admitter(store, run.id);
    for (const { examples: indices } of plan.prepared.plan) {
      const s = plan.prepared.sequences[indices[0]!]!;
      const n = s.tokens.length;
      const T = n - 1;
      const weights = Array.from({ length: T }, (_, t) => s.weights[t + 1]! / s.trainable);
      await admit("forward_backward", {
        batch: {
          matrices: [
            {
              matrix_id: "m",
              rows: [
                dense("token_ids", "int64", [T], s.tokens.slice(0, T)),
                dense("target_token_ids", "int64", [T, 1], s.tokens.slice(1, n)),
                dense("loss_weights", "float32", [T, 1], weights),
              ],
            },
          ],
        },
        loss: { name: "cross_entropy" },
        return_token_logprobs: false,
      });
      await admit("optim_step", {
        optimizer: {
          learning_rate: lr,
          beta1: 0.9,
          beta2: 0.999,
          eps: 1e-8,
          weight_decay: 0,
          grad_clip_norm: 1,
        },
      });
    }
    await drain(executor, run.id);
    const learner = await committedLearner("e", run.id, examples.length, base);
    expect(weights(learner)).toEqual(weights(job.adapter));
    expect(weights(learner)).not.toEqual(weights(freshAdapter(base, spec, run.id)));
  });
});

/**
 * The native API's `cispo` against the preview RL job's step (`trainRlStep` with the job's
 * mapping, `rlStepConfig`, at its defaults: loss cispo, ε 1, ε_high 4, rewards scaled, max grad
 * norm 1, learning rate 1e-5; AdamW 0.9/0.999/1e-8, no decay). The preview's objective per trained
 * token is −clip(ρ, 1−ε, 1+ε_high)·Â·w_traj/(n·H)·log π, where Â is the group-relative advantage
 * divided by the batch's mean |Â|·w_traj, w_traj the trajectory's 1/n normalised to mean 1, n the
 * history's trained tokens and H the step's histories. A TokenMatrix carries it exactly: the
 * client computes Â and w_traj/(n·H) itself and sends them as `advantages` and `loss_weights`
 * with `normalize_advantages: false` (the API's normalisation divides by mean |A|·w, where w
 * would then include the 1/(n·H) the preview applies after normalising), clip thresholds 0 and 5
 * (the API clamps ρ itself), and every trained token's sampling log-prob as `behavior_logprobs`
 * (the preview's ρ = 1 for a token without one has no TokenMatrix value). Bitwise equality further
 * needs the same float operations: two completions of 4 trained tokens each (so w_traj = 1 and
 * 1/(n·H) = 1/8, Â = ±1, every product a scaling by a power of two), and the preview's
 * micro-batches one history each (`microBatchTokens` = a history's length; the job's default
 * packs both in one batch, whose parameter gradients the kernels sum in another order than two
 * matrices' backward passes added one after the other).
 */
describe("RunExecutor learner blobs", () => {
  it("when a run takes more optim_steps, then its blobs do not grow: each commit deletes the state and gradient it superseded, and the sweep the blobs of an expired saved state", async () => {
    const base = await loadModel(catalogModelDir(BASE));
    const kernels = createWasmKernels("auto", { threads: 1 });
    let clock = Date.now();
    const own = await openStore({ dataDir: ":memory:", now: () => clock });
    await own.entities.ensure("blobs");
    const run = await own.trainingRuns.resolve({
      entity: "blobs",
      request_id: "resolve-blobs",
      fingerprint: "f",
      run_name: null,
      spec: { base_model: BASE, lora_rank: 2, lora_target_modules: ["q_proj", "v_proj"], seed: 3 },
      initial: null,
    });
    const executor = new RunExecutor(own, base, kernels);
    const admit = admitter(own, run.id);
    const tokens = [1, 2, 3, 4, 5];
    const step = async () => {
      for (let i = 0; i < 2; i++)
        await admit("forward_backward", {
          batch: {
            matrices: [
              {
                matrix_id: "m",
                rows: [
                  dense("token_ids", "int64", [4], tokens.slice(0, 4)),
                  dense("target_token_ids", "int64", [4, 1], tokens.slice(1)),
                  dense("loss_weights", "float32", [4, 1], [0.25, 0.25, 0.25, 0.25]),
                ],
              },
            ],
          },
          loss: { name: "cross_entropy" },
          return_token_logprobs: false,
        });
      await admit("optim_step", { optimizer: { learning_rate: 1e-3 } });
      await drain(executor, run.id, own);
    };
    const files = () => own.blobs.list(runFilesPrefix(run.id));
    await step();
    const afterOne = await files();
    expect(afterOne).toHaveLength(3);
    for (let i = 0; i < 3; i++) await step();
    const afterFour = await files();
    expect(afterFour).toHaveLength(afterOne.length);
    const committed = (await own.trainingRuns.get("blobs", run.id))!;
    expect(committed.committed_version).toBe(4);
    expect(afterFour.every((key) => key.startsWith(committed.state_key!))).toBe(true);

    // A saved state keeps its state's blobs after the run moves on, until it expires.
    await admit("save_state", { checkpoint_name: "kept", ttl_seconds: 60, overwrite: false });
    await drain(executor, run.id, own);
    await step();
    expect((await files()).length).toBe(2 * afterOne.length);
    const sweep = () => sweepBlobs(own, { now: () => clock });
    expect((await sweep()).runs).toEqual([]);
    clock += 16 * 60_000;
    const swept = await sweep();
    expect(swept.runs).toHaveLength(1);
    expect(swept.runs[0]).not.toBe((await own.trainingRuns.get("blobs", run.id))!.state_key);
    expect(await files()).toHaveLength(afterOne.length);
    await own.close();
  });
});

describe("RunExecutor RL", () => {
  it("when the same rollouts take two steps through the preview RL step and through cispo forward_backward + optim_step, then the adapters are bitwise equal", async () => {
    const base = await loadModel(catalogModelDir(BASE));
    const spec: RunSpec & Record<string, Json> = {
      base_model: BASE,
      lora_rank: 4,
      lora_target_modules: ["down_proj", "k_proj", "lm_head", "o_proj", "q_proj", "v_proj"],
      seed: 3,
    };
    await store.entities.ensure("rl");
    const run = await store.trainingRuns.resolve({
      entity: "rl",
      request_id: "resolve-rl",
      fingerprint: "f",
      run_name: null,
      spec,
      initial: null,
    });
    const prompt = { role: "user", content: "Reverse cat" } as const;
    // A sampling log-prob of −30 puts ρ far above 1 + ε_high: those tokens take the clamp (with
    // clip_high_threshold 4 instead of 5 the adapters differ).
    const rollouts = [
      { answer: "tic", reward: 1, logprobs: [-0.5, -30, -1, -3] },
      { answer: "xyz", reward: 0, logprobs: [-2, -0.25, -30, -4] },
    ];
    const groups: TrajectoryGroup[] = [
      {
        trajectories: rollouts.map(({ answer, reward, logprobs }) => ({
          reward,
          messages_and_choices: [
            prompt,
            {
              index: 0,
              finish_reason: "stop",
              message: { role: "assistant", content: answer },
              logprobs: { content: logprobs.map((logprob) => ({ token: "", logprob })) },
            },
          ],
        })),
      },
    ];
    const { config, learningRate, maxGradNorm } = rlStepConfig({ loss_fn: "cispo" }, 0);
    const rows = rollouts.map(({ answer, reward, logprobs }) => {
      const chat = base.chat.trainingTokens(
        [prompt, { role: "assistant", content: answer }],
        (i) => i === 1,
        {},
      );
      const n = chat.tokens.length;
      const trained = Array.from(chat.mask.subarray(1)).reduce((a, b) => a + b, 0);
      expect(trained).toBe(logprobs.length);
      const behavior = [...logprobs];
      const T = n - 1;
      const active = (p: number) => chat.mask[p + 1] === 1;
      return {
        n,
        matrix: {
          matrix_id: answer,
          rows: [
            dense("token_ids", "int64", [T], chat.tokens.slice(0, T)),
            dense("target_token_ids", "int64", [T, 1], chat.tokens.slice(1, n)),
            dense(
              "advantages",
              "float32",
              [T, 1],
              Array.from({ length: T }, (_, p) => (active(p) ? (reward === 1 ? 1 : -1) : 0)),
            ),
            dense(
              "behavior_logprobs",
              "float32",
              [T, 1],
              Array.from({ length: T }, (_, p) => (active(p) ? behavior.shift()! : 0)),
            ),
            dense("loss_weights", "float32", [T, 1], new Array<number>(T).fill(1 / (4 * 2))),
          ],
        } as Json,
      };
    });
    expect(rows.map((r) => r.n)).toEqual([19, 19]);

    const kernels = createWasmKernels("auto", { threads: 1 });
    const preview = new LoraTrainer(base, freshAdapter(base, spec, run.id), {
      maxGradNorm,
      kernels,
    });
    const steps = 2;
    for (let i = 0; i < steps; i++)
      trainRlStep(preview, groups, learningRate, { ...config, microBatchTokens: rows[0]!.n });

    const admit = admitter(store, run.id);
    for (let i = 0; i < steps; i++) {
      await admit("forward_backward", {
        batch: { matrices: rows.map((r) => r.matrix) },
        loss: {
          name: "cispo",
          normalize_advantages: false,
          clip_low_threshold: 0,
          clip_high_threshold: 5,
        },
        return_token_logprobs: false,
      });
      await admit("optim_step", {
        optimizer: {
          learning_rate: learningRate,
          beta1: 0.9,
          beta2: 0.999,
          eps: 1e-8,
          weight_decay: 0,
          grad_clip_norm: maxGradNorm,
        },
      });
    }
    await drain(new RunExecutor(store, base, kernels), run.id);
    const learner = await committedLearner("rl", run.id, steps, base);
    expect(weights(learner)).toEqual(weights(preview.adapter));
    expect(weights(learner)).not.toEqual(weights(freshAdapter(base, spec, run.id)));
  });
});

describe("RunExecutor publication", () => {
  it("when the model has a training job queued, then save_weights_for_sampler fails alone with operation_conflict", async () => {
    const base = await loadModel(catalogModelDir(BASE));
    await store.entities.ensure("p");
    const { model } = await store.models.create({
      entity: "p",
      project: "proj",
      name: "busy",
      base_model: BASE,
    });
    await store.jobs.enqueue({ type: "sft", model_id: model.id, entity: "p" });
    const run = await store.trainingRuns.resolve({
      entity: "p",
      request_id: "resolve-busy",
      fingerprint: "f",
      run_name: null,
      spec: { base_model: BASE, lora_rank: 2, lora_target_modules: ["q_proj"], seed: 1 },
      initial: null,
    });
    const op = await store.trainingRuns.admit(run.id, {
      kind: "save_weights_for_sampler",
      request_id: "publish",
      fingerprint: "p",
      sequence_id: 0,
      body: { publication: { target: "saved_generation", model_alias: "busy" } },
      resolved: { model_id: model.id, entity: "p", model_alias: "p/proj/busy" },
    });
    const executor = new RunExecutor(store, base, createWasmKernels("auto", { threads: 1 }));
    const { outcome } = await executor.execute(run, op);
    expect(outcome).toEqual({ status: "failed", code: "operation_conflict" });
  });
});

/** The run's committed learner, which must be at `version`. */
/**
 * A cancel of a running operation (ADR 64): the executor reads the flag at its safe points, and
 * the test asks for the cancel from inside one (the `atSafePoint` gate), so where the operation
 * stops is chosen, not raced. Nothing of a cancelled operation is applied: the open gradient and
 * the committed learner are the blobs they were, byte for byte.
 */
describe("RunExecutor cancel", () => {
  const matrix = (id: string, tokens: number[]) => ({
    matrix_id: id,
    rows: [
      dense("token_ids", "int64", [4], tokens.slice(0, 4)),
      dense("target_token_ids", "int64", [4, 1], tokens.slice(1)),
      dense("loss_weights", "float32", [4, 1], [0.25, 0.25, 0.25, 0.25]),
    ],
  });
  const forwardBackward = {
    batch: { matrices: [matrix("a", [1, 2, 3, 4, 5]), matrix("b", [6, 7, 8, 9, 10])] },
    loss: { name: "cross_entropy" },
    return_token_logprobs: false,
  };

  /** A run with one step committed (learner v1) and one forward_backward open after it. */
  async function steppedRun(name: string) {
    const base = await loadModel(catalogModelDir(BASE));
    const own = await openStore({ dataDir: ":memory:" });
    await own.entities.ensure(name);
    const run = await own.trainingRuns.resolve({
      entity: name,
      request_id: `resolve-${name}`,
      fingerprint: "f",
      run_name: null,
      spec: { base_model: BASE, lora_rank: 2, lora_target_modules: ["q_proj", "v_proj"], seed: 5 },
      initial: null,
    });
    const admit = admitter(own, run.id);
    await admit("forward_backward", forwardBackward);
    await admit("optim_step", { optimizer: { learning_rate: 1e-2 } });
    await admit("forward_backward", forwardBackward);
    await drain(new RunExecutor(own, base, createWasmKernels("auto", { threads: 1 })), run.id, own);
    const before = (await own.trainingRuns.get(name, run.id))!;
    expect(before).toMatchObject({ committed_version: 1, status: "open" });
    const blobs = async () => {
      const keys = (await own.blobs.list(runFilesPrefix(run.id))).sort();
      return Promise.all(keys.map(async (k) => [k, Buffer.from((await own.blobs.get(k))!)]));
    };
    return { base, own, run, admit, before, blobs, snapshot: await blobs() };
  }

  /** Runs the run's operations, cancelling the one at `sequence` at its `nth` `point`. */
  async function runCancelling(
    t: Awaited<ReturnType<typeof steppedRun>>,
    sequence: number,
    point: SafePoint,
    nth: number,
  ) {
    const seen: string[] = [];
    let reached = 0;
    const executor = new RunExecutor(t.own, t.base, createWasmKernels("auto", { threads: 1 }), {
      atSafePoint: async (op, at) => {
        seen.push(`${op.sequence_id}:${at}`);
        if (op.sequence_id !== sequence || at !== point || ++reached !== nth) return;
        const flagged = await t.own.trainingRuns.cancel(t.run.id, op.id);
        expect(flagged).toMatchObject({ status: "running", cancel_requested: true });
      },
    });
    const outcomes: { sequence: number; status: string }[] = [];
    await t.own.trainingRuns.claimRun("w", 60_000);
    await executor.runOperations("w", t.run.id, {
      onDropError: (err) => {
        throw err;
      },
      onExecuted: (op, outcome, activity) => {
        outcomes.push({ sequence: op.sequence_id, status: outcome.status });
        if (outcome.status === "cancelled") expect(activity.outcome).toBe("cancelled");
      },
    });
    return { seen, outcomes };
  }

  it("when a running forward_backward is cancelled between its micro-batches, then it ends cancelled, its partial gradient is not added to the open one, and the run fails with its learner untouched", async () => {
    const t = await steppedRun("cancel-fb");
    await t.admit("forward_backward", forwardBackward); // 3: cancelled after its first matrix
    await t.admit("optim_step", { optimizer: { learning_rate: 1e-2 } }); // 4: never runs
    const { seen, outcomes } = await runCancelling(t, 3, "micro_batch", 2);
    // It stopped before its second matrix: one backward ran, none after it.
    expect(seen.filter((s) => s.startsWith("3:"))).toEqual([
      "3:start",
      "3:micro_batch",
      "3:micro_batch",
    ]);
    expect(seen.some((s) => s.startsWith("4:"))).toBe(false);
    expect(outcomes).toEqual([{ sequence: 3, status: "cancelled" }]);
    const ops = await t.own.trainingRuns.listOperations(t.run.id);
    expect(ops.data.map((o) => [o.sequence_id, o.status, o.error_code, o.loss])).toEqual([
      [0, "succeeded", null, expect.any(Number)],
      [1, "succeeded", null, null],
      [2, "succeeded", null, expect.any(Number)],
      [3, "cancelled", "cancelled", null],
      [4, "failed", "execution_failed", null],
    ]);
    expect(ops.data[3]).toMatchObject({ cancel_requested: true, open_gradient: false });
    const after = (await t.own.trainingRuns.get("cancel-fb", t.run.id))!;
    expect(after).toMatchObject({
      status: "failed",
      committed_version: 1,
      state_key: t.before.state_key,
      grad_key: t.before.grad_key,
    });
    expect(await t.blobs()).toEqual(t.snapshot);
    await t.own.close();
  });

  it("when a running optim_step is cancelled before it applies, then it ends cancelled and the learner version, its state and the open gradient stay as they were", async () => {
    const t = await steppedRun("cancel-step");
    await t.admit("optim_step", { optimizer: { learning_rate: 1e-2 } }); // 3: cancelled
    const { outcomes } = await runCancelling(t, 3, "apply", 1);
    expect(outcomes).toEqual([{ sequence: 3, status: "cancelled" }]);
    const op = (await t.own.trainingRuns.listOperations(t.run.id)).data[3]!;
    expect(op).toMatchObject({ status: "cancelled", error_code: "cancelled", reserved_version: 2 });
    const after = (await t.own.trainingRuns.get("cancel-step", t.run.id))!;
    expect(after).toMatchObject({
      status: "failed",
      committed_version: 1,
      state_key: t.before.state_key,
      grad_key: t.before.grad_key,
    });
    expect(await t.blobs()).toEqual(t.snapshot);
    await t.own.close();
  });

  it("when a running save_state is cancelled before it saves, then it ends cancelled alone: no state is saved and the run stays open", async () => {
    const t = await steppedRun("cancel-save");
    await t.admit("save_state", { checkpoint_name: "s", ttl_seconds: null, overwrite: false });
    const { outcomes } = await runCancelling(t, 3, "apply", 1);
    expect(outcomes).toEqual([{ sequence: 3, status: "cancelled" }]);
    const after = (await t.own.trainingRuns.get("cancel-save", t.run.id))!;
    expect(after).toMatchObject({ status: "open", committed_version: 1 });
    expect(await t.own.trainingRuns.referencedLearnerKeys([t.before.state_key!])).toEqual(
      new Set([t.before.state_key]),
    );
    expect(await t.blobs()).toEqual(t.snapshot);
    await t.own.close();
  });

  it("when the cancel comes after an operation's last safe point, then it succeeds as if none came", async () => {
    const t = await steppedRun("cancel-late");
    await t.admit("forward", forwardBackward);
    const late = new RunExecutor(t.own, t.base, createWasmKernels("auto", { threads: 1 }));
    await t.own.trainingRuns.claimRun("w", 60_000);
    const op = (await t.own.trainingRuns.nextOperation(t.run.id))!;
    const running = (await t.own.trainingRuns.startOperation("w", op))!;
    const { outcome } = await late.execute(running, op);
    await t.own.trainingRuns.cancel(t.run.id, op.id);
    const finished = await t.own.trainingRuns.finishOperation("w", op, outcome);
    expect(finished).toMatchObject({
      status: "succeeded",
      cancel_requested: true,
      error_code: null,
    });
    expect(finished!.loss).toBeGreaterThan(0);
    expect(finished!.tokens).toBe(8);
    await t.own.close();
  });
});

async function committedLearner(
  entity: string,
  runId: string,
  version: number,
  base: Model,
): Promise<LoraAdapter> {
  const trained = (await store.trainingRuns.get(entity, runId))!;
  expect(trained.committed_version).toBe(version);
  return adapterFromFiles(await readCheckpointFiles(store.blobs, trained.state_key!), base);
}

function weights(adapter: LoraAdapter): Record<string, number[]> {
  return Object.fromEntries(loraParameters(adapter).map((p) => [p.name, Array.from(p.data)]));
}

function dense(name: string, dtype: string, shape: number[], data: readonly number[]) {
  return { name, dtype, shape, values: { encoding: "dense", data: [...data] } } as Json;
}

/** Admits commands to the run in sequence from 0, each under its own request id. */
function admitter(into: typeof store, runId: string) {
  let sequence = 0;
  return (kind: OperationKind, body: Json) =>
    into.trainingRuns.admit(runId, {
      kind,
      request_id: `${kind}-${sequence}`,
      fingerprint: `${sequence}`,
      sequence_id: sequence++,
      body,
    });
}

/** Runs the run's admitted operations in order, as the worker does; each must succeed. */
async function drain(executor: RunExecutor, runId: string, into = store): Promise<void> {
  await into.trainingRuns.claimRun("w", 60_000);
  await executor.runOperations("w", runId, {
    onDropError: (err) => {
      throw err;
    },
    onExecuted: (_op, outcome) => expect(outcome).toMatchObject({ status: "succeeded" }),
  });
  expect(await into.trainingRuns.nextOperation(runId)).toBeUndefined();
}
