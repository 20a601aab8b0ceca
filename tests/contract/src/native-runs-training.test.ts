import { randomUUID } from "node:crypto";
import type { ArborClient, Checkpoint } from "@arbor/client";
import { beforeAll, describe, expect, it } from "vitest";
import {
  adam,
  OperationFailed,
  RunClient,
  type TrainingRuns,
  wireLoss,
} from "./native-runs/client.ts";
import {
  BASE,
  CROSS_ENTROPY,
  nativeServer,
  refused,
  requestId,
  reversalBatch,
  rollout,
  SPEC,
  sftStep,
} from "./native-runs/fixtures.ts";
import {
  activePositions,
  logprobValues,
  tokenMatrixBatchFromArtRollouts,
} from "./native-runs/token-matrix.ts";
import type { TokenMatrixBatch } from "./native-runs/wire.ts";
import { STORES } from "./pg.ts";

/** Two lists of learner log-probs agree to 5 decimals, value by value. */
function expectClose(actual: number[], expected: number[]): void {
  expect(actual).toHaveLength(expected.length);
  for (const [i, value] of actual.entries()) expect(value).toBeCloseTo(expected[i]!, 5);
}

/**
 * Training through the native API (ADR 57) as ART's ServerlessBackend does it: SFT by
 * cross-entropy forward_backward and optim_step, RL by CISPO on rollouts lowered as ART lowers
 * them, publication of a learner version as a model's checkpoint step, and saved states loaded
 * back. Each case runs on SQLite and on PostgreSQL.
 */
describe.each(STORES)("training through the native API on $name", (store) => {
  const native = nativeServer(store);
  let runs: TrainingRuns;
  let client: ArborClient;
  beforeAll(() => {
    if (store.skip !== null) return;
    runs = native.runs();
    client = native.server().authorizedClient();
  });
  const test = it.skipIf(store.skip !== null);
  const openRun = native.openRun;
  const unique = (prefix: string) => `${prefix}-${randomUUID().slice(0, 8)}`;
  const newModel = (project: string, name: string) =>
    client.training.models.create({ project, name, base_model: BASE });
  const checkpoints = async (modelId: string): Promise<Checkpoint[]> => {
    const out: Checkpoint[] = [];
    for await (const c of client.training.models.checkpoints.list(modelId, { order: "asc" }))
      out.push(c);
    return out;
  };
  /** A save_weights_for_sampler of the run's next sequence id into `alias`, as submitted. */
  const submitPublication = (run: RunClient, alias: string) =>
    runs.submit(run.runId, {
      kind: "save_weights_for_sampler",
      body: {
        request_id: requestId("publish"),
        sequence_id: run.nextSequenceId,
        checkpoint_name: "step-1",
        ttl_seconds: null,
        publication: { target: "saved_generation", model_alias: alias },
      },
    });
  /** The learner's log-probs of a batch's targets, by a forward of the run. */
  const learnerLogprobs = async (run: RunClient, batch: TokenMatrixBatch) => {
    const result = await (
      await run.forward({ requestId: requestId("fwd"), batch, loss: CROSS_ENTROPY })
    ).result();
    return result.token_logprobs.map(logprobValues);
  };
  const firstLogprob = async (model: string) => {
    const completion = await client.chat.completions.create({
      model,
      messages: [{ role: "user", content: "Reverse the word cat." }],
      max_tokens: 4,
      temperature: 0,
      logprobs: true,
    });
    return {
      model: completion.model,
      logprob: completion.choices[0]!.logprobs!.content![0]!.logprob,
    };
  };

  describe("createForwardBackwardOperation", () => {
    test("when SFT runs as ART's backend runs it (cross_entropy forward_backward, then optim_step), then the loss goes down over the steps and each step makes the next learner version", async () => {
      const run = await openRun();
      const batch = await reversalBatch(["cat", "dog", "sun", "map"]);
      const losses: number[] = [];
      for (let step = 1; step <= 10; step++) {
        const { forward, optimizer } = await sftStep(run, batch);
        losses.push(forward.loss.value);
        expect(forward.training.accepted_trainable_tokens).toBe(
          batch.matrices.reduce((n, m) => n + activePositions(m, false), 0),
        );
        expect(optimizer.learner_version).toBe(step);
      }
      expect(losses.at(-1)!).toBeLessThan(losses[0]! * 0.8);
      expect(await runs.get(run.runId)).toMatchObject({
        next_sequence_id: 20,
        committed_learner_version: 10,
      });
    });

    test("when RL runs as ART's backend runs it (rollouts lowered with spans, CISPO clipped at 1 − ε and 1 + ε_high), then the step counts each policy version's tokens and trains", async () => {
      const run = await openRun();
      // The behavior log-probs are the learner's own (on-policy), read by a forward.
      const answers = ["tac", "cat"];
      const [sampled] = await learnerLogprobs(run, await reversalBatch(["cat"]));
      const group = await Promise.all(
        answers.map((answer, i) =>
          rollout("cat", {
            answer,
            advantage: i === 0 ? 1 : -1,
            weight: 1,
            promptId: 0,
            logprob: (p) => (answer === "tac" ? sampled![p - 1]! : -2),
          }),
        ),
      );
      const batch = tokenMatrixBatchFromArtRollouts(
        group.map((r) => ({ ...r, policyVersions: r.tokenIds.map(() => 0) })),
      );
      expect(batch.matrices.map((m) => m.packing_affinity_id)).toEqual(["prompt-0", "prompt-0"]);
      const fb = await run.forwardBackward({
        requestId: requestId("fb"),
        batch,
        loss: wireLoss("cispo", { normalizeAdvantages: false, clipLow: 0, clipHigh: 5 }),
        returnTokenLogprobs: false,
      });
      const result = await fb.result();
      const accepted = batch.matrices.reduce((n, m) => n + activePositions(m, true), 0);
      expect(result.training).toEqual({
        accepted_trainable_tokens: accepted,
        policy_token_counts: [{ policy_version: 0, accepted_trainable_tokens: accepted }],
      });
      expect(result.loss.contract_id).toBe("cispo_v1");
      expect(result.produced_gradient).toBe(true);
      const step = await (await run.optimStep(requestId("optim"), adam(5e-6))).result();
      expect(step.contributing_operation_ids).toEqual([fb.id]);
      expect(step.learner_version).toBe(1);
    });
  });

  describe("createSaveWeightsForSamplerOperation", () => {
    test("when learner version v is published into a model, then <model>:step<v> chats with the new weights, listCheckpoints lists step v under the generation id, and the model's name serves it", async () => {
      const project = unique("native");
      const name = unique("pub");
      const model = await newModel(project, name);
      const id = `default/${project}/${name}`;
      const run = await openRun();
      await sftStep(run, await reversalBatch(["cat", "dog"]));
      const published = await (
        await run.saveWeightsForSampler({
          requestId: requestId("publish"),
          checkpointName: "step-1",
          modelAlias: name,
        })
      ).result();
      expect(published).toMatchObject({
        target: "saved_generation",
        model_alias: id,
        learner_version: 1,
        checkpoint: { learner_version: 1 },
      });
      const listed = await checkpoints(model.id);
      expect(listed.map((c) => c.step)).toEqual([0, 1]);
      expect(listed[1]).toMatchObject({ id: published.generation_id, model: `${id}:step1` });
      const base = await firstLogprob(`${id}:step0`);
      const trained = await firstLogprob(`${id}:step1`);
      expect(trained.logprob).not.toBe(base.logprob);
      expect((await firstLogprob(id)).model).toBe(`${id}:step1`);
      expect((await firstLogprob(`wandb-artifact:///${id}:step1`)).logprob).toBe(trained.logprob);
      // The same version published again (ART's in_flight_lora) replaces the step.
      const again = await (
        await run.saveWeightsForSampler({
          requestId: requestId("publish"),
          checkpointName: "step-1",
          modelAlias: id,
          mode: "in_flight_lora",
        })
      ).result();
      expect(again).toMatchObject({ target: "active", learner_version: 1, model_alias: id });
      expect(again.generation_id).not.toBe(published.generation_id);
      const relisted = await checkpoints(model.id);
      expect(relisted.map((c) => [c.step, c.id])).toEqual([
        [0, listed[0]!.id],
        [1, again.generation_id],
      ]);
    });

    test("when a bare model_alias names models in two projects, then 409 ambiguous_model_alias names both; the full id publishes; an unknown name is 404 model_not_found", async () => {
      const name = unique("twin");
      const [a, b] = [unique("left"), unique("right")];
      await newModel(a, name);
      await newModel(b, name);
      const run = await openRun();
      await sftStep(run, await reversalBatch(["cat"]));
      const publish = (alias: string) => submitPublication(run, alias);
      const ambiguous = await refused(publish(name), 409, "ambiguous_model_alias");
      expect(ambiguous.error.message).toContain(`default/${a}/${name}`);
      expect(ambiguous.error.message).toContain(`default/${b}/${name}`);
      await refused(publish(unique("nobody")), 404, "model_not_found");
      expect((await runs.get(run.runId)).next_sequence_id).toBe(2);
      const published = await (
        await run.saveWeightsForSampler({
          requestId: requestId("publish"),
          checkpointName: "step-1",
          modelAlias: `default/${a}/${name}`,
        })
      ).result();
      expect(published.model_alias).toBe(`default/${a}/${name}`);
    });

    test("when a model has checkpoints of another LoRA rank or other target modules than the run, then 409 adapter_mismatch names what differs; a model without checkpoints takes any", async () => {
      const project = unique("adapters");
      const model = await newModel(project, unique("m"));
      const alias = `default/${project}/${model.name}`;
      const trained = async (spec: typeof SPEC) => {
        const run = await RunClient.resolve(runs, { requestId: requestId("resolve"), spec });
        await sftStep(run, await reversalBatch(["cat"]));
        return run;
      };
      const trainAndPublish = async (spec: typeof SPEC) => {
        return submitPublication(await trained(spec), alias);
      };
      const rank8 = { ...SPEC, lora_rank: 8 };
      const published = await (
        await (
          await trained(rank8)
        ).saveWeightsForSampler({
          requestId: requestId("publish"),
          checkpointName: "step-1",
          modelAlias: alias,
        })
      ).result();
      expect(published.model_alias).toBe(alias);
      expect((await checkpoints(model.id)).map((c) => c.step)).toEqual([0, 1]);
      const rank = await refused(trainAndPublish(SPEC), 409, "adapter_mismatch");
      expect(rank.error.message).toContain("LoRA rank 8, the run 4");
      const targets = await refused(
        trainAndPublish({ ...rank8, lora_target_modules: ["q_proj", "v_proj"] }),
        409,
        "adapter_mismatch",
      );
      expect(targets.error.message).toContain("target modules");
      expect(targets.error.message).toContain("the run [q_proj, v_proj]");
    });
  });

  describe("createSaveStateOperation", () => {
    test("when a state is saved and loaded back, then the learner is the saved one again, in this run and in a new run resolved from it; a name saved twice without overwrite fails only that operation", async () => {
      const run = await openRun();
      const batch = await reversalBatch(["cat", "dog"]);
      const probe = await reversalBatch(["map"]);
      await sftStep(run, batch);
      const saved = await (
        await run.saveState({ requestId: requestId("save"), checkpointName: "after-1" })
      ).result();
      const checkpointId = saved.checkpoint.checkpoint_id;
      expect(saved.checkpoint.learner_version).toBe(1);
      expect(saved.archive).toMatchObject({ checkpoint_id: checkpointId, learner_version: 1 });
      expect([...saved.archive!.components].sort()).toEqual(["optimizer", "weights"]);
      expect(saved.archive!.wandb_artifact).toMatch(
        new RegExp(`^default/[^/:]+/${checkpointId}:v1$`),
      );
      const [atSave] = await learnerLogprobs(run, probe);
      await sftStep(run, batch);
      const [moved] = await learnerLogprobs(run, probe);
      expect(moved).not.toEqual(atSave);
      const load = await run.loadState({
        requestId: requestId("load"),
        checkpoint: `service-checkpoint:${checkpointId}`,
        restoreOptimizer: true,
      });
      expect(load.admitted.reserved_output_learner_version).toBe(3);
      const loaded = await load.result();
      expect(loaded).toMatchObject({
        optimizer_restored: true,
        checkpoint: { learner_version: 3 },
      });
      const [reloaded] = await learnerLogprobs(run, probe);
      expectClose(reloaded!, atSave!);

      const resumed = await RunClient.resolve(runs, {
        requestId: requestId("resolve"),
        spec: SPEC,
        initialState: {
          source: { kind: "service_checkpoint", checkpoint_id: checkpointId },
          restore_optimizer: true,
        },
      });
      expect(await runs.get(resumed.runId)).toMatchObject({
        next_sequence_id: 0,
        projected_learner_version: 1,
        committed_learner_version: 1,
      });
      const [fresh] = await learnerLogprobs(resumed, probe);
      expectClose(fresh!, atSave!);
      const step = await sftStep(resumed, batch);
      expect(step.optimizer.learner_version).toBe(2);

      const twice = await run.saveState({
        requestId: requestId("save"),
        checkpointName: "after-1",
      });
      const error = await twice.result().then(
        () => null,
        (err: unknown) => err,
      );
      expect(error).toBeInstanceOf(OperationFailed);
      expect((error as OperationFailed).operation.error).toEqual({ code: "operation_conflict" });
      expect((await runs.get(run.runId)).status).toBe("open");
      const replaced = await (
        await run.saveState({
          requestId: requestId("save"),
          checkpointName: "after-1",
          overwrite: true,
        })
      ).result();
      expect(replaced.checkpoint.checkpoint_id).not.toBe(checkpointId);
      expect(replaced.checkpoint.learner_version).toBe(3);
    });

    test("when a saved state of another spec is loaded, then 409 checkpoint_incompatible", async () => {
      const run = await openRun();
      await sftStep(run, await reversalBatch(["cat"]));
      const saved = await (
        await run.saveState({ requestId: requestId("save"), checkpointName: "rank-4" })
      ).result();
      await refused(
        runs.resolve({
          requestId: requestId("resolve"),
          spec: { ...SPEC, lora_rank: 8 },
          initialState: {
            source: { kind: "service_checkpoint", checkpoint_id: saved.checkpoint.checkpoint_id },
            restore_optimizer: false,
          },
        }),
        409,
        "checkpoint_incompatible",
      );
    });
  });
});
