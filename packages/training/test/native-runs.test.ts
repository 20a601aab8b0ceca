import { createWasmKernels } from "@arbor/engine/kernels";
import {
  adapterFromFiles,
  catalogModelDir,
  type LoraAdapter,
  loadModel,
  loraParameters,
} from "@arbor/engine/model";
import { planSft, type SftExample, trainSft } from "@arbor/engine/train";
import { type Json, type OperationKind, openStore } from "@arbor/store";
import { afterAll, describe, expect, it } from "vitest";
import { readCheckpointFiles } from "../src/checkpoints.ts";
import { freshAdapter, RunExecutor, type RunSpec } from "../src/runs/execute.ts";

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
    let sequence = 0;
    const admit = (kind: OperationKind, body: Json) =>
      store.trainingRuns.admit(run.id, {
        kind,
        request_id: `${kind}-${sequence}`,
        fingerprint: `${sequence}`,
        sequence_id: sequence++,
        body,
      });
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
    await store.trainingRuns.claimRun("w", 60_000);
    for (let op = await store.trainingRuns.nextOperation(run.id); op; ) {
      expect(await store.trainingRuns.startOperation("w", op)).toBe(true);
      const current = (await store.trainingRuns.get("e", run.id))!;
      const { outcome } = await executor.execute(current, op);
      expect(outcome).toMatchObject({ status: "succeeded" });
      await store.trainingRuns.finishOperation("w", op, outcome);
      op = await store.trainingRuns.nextOperation(run.id);
    }
    const trained = (await store.trainingRuns.get("e", run.id))!;
    expect(trained.committed_version).toBe(examples.length);
    const learner = adapterFromFiles(
      await readCheckpointFiles(store.blobs, trained.state_key!),
      base,
    );
    expect(weights(learner)).toEqual(weights(job.adapter));
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

function weights(adapter: LoraAdapter): Record<string, number[]> {
  return Object.fromEntries(loraParameters(adapter).map((p) => [p.name, Array.from(p.data)]));
}

function dense(name: string, dtype: string, shape: number[], data: readonly number[]) {
  return { name, dtype, shape, values: { encoding: "dense", data: [...data] } } as Json;
}
