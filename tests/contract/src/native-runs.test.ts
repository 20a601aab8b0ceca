import { randomUUID } from "node:crypto";
import { beforeAll, describe, expect, it } from "vitest";
import type { RunningServer } from "./harness.ts";
import {
  adam,
  forwardBody,
  OperationFailed,
  RunClient,
  TrainingRuns,
  wireLoss,
} from "./native-runs/client.ts";
import {
  CROSS_ENTROPY,
  nativeServer,
  refused,
  requestId,
  reversalBatch,
  rollout,
  SPEC,
  sftStep,
  tinyModel,
} from "./native-runs/fixtures.ts";
import {
  activePositions,
  batchOf,
  denseRow,
  denseValues,
  logprobValues,
  tokenMatrixBatchFromArtRollouts,
} from "./native-runs/token-matrix.ts";
import type {
  CheckpointSource,
  Operation,
  TokenMatrix,
  TokenMatrixBatch,
  TokenRow,
} from "./native-runs/wire.ts";
import { STORES } from "./pg.ts";

/** The matrix's row `name` replaced by `row` (or removed, when null). */
function withRow(matrix: TokenMatrix, name: string, row: TokenRow | null): TokenMatrix {
  const rows = matrix.rows.filter((r) => r.name !== name);
  return { ...matrix, rows: row ? [...rows, row] : rows };
}

function onlyMatrix(batch: TokenMatrixBatch): TokenMatrix {
  return batch.matrices[0]!;
}

/** The matrix with two targets per position: each target and token 12, each coefficient twice. */
function widen(matrix: TokenMatrix): TokenMatrix {
  return {
    ...matrix,
    rows: matrix.rows.map((row) => {
      if (row.shape.length < 2) return row;
      const values = denseValues(row);
      const wide =
        row.name === "target_token_ids"
          ? values.flatMap((t) => [t, 12])
          : values.flatMap((v) => [v, v]);
      return denseRow(row.name, row.dtype, [row.shape[0]!, 2], wide);
    }),
  };
}

/**
 * The native training API (ADR 57) as OpenPipe ART's ServerlessBackend drives it: runs, the
 * ledger of sequenced commands, operations and their results, TokenMatrix validation. Every
 * answer goes through a client that checks it as ART's does (native-runs/). Each case runs on
 * SQLite and on PostgreSQL.
 */
describe.each(STORES)("the native training API on $name", (store) => {
  const native = nativeServer(store);
  let server: RunningServer;
  let runs: TrainingRuns;
  beforeAll(() => {
    if (store.skip !== null) return;
    server = native.server();
    runs = native.runs();
  });
  const test = it.skipIf(store.skip !== null);
  const openRun = native.openRun;
  /** A forward of one reversal example, run to its end. */
  const finishedForward = async (run: RunClient) => {
    const op = await run.forward({
      requestId: requestId("fwd"),
      batch: await reversalBatch(["cat"]),
      loss: CROSS_ENTROPY,
    });
    await op.result();
    return op;
  };
  /** A batch of one matrix whose rows serve a policy loss: advantages +1, behavior −1. */
  const policyBatch = async (word = "cat") =>
    tokenMatrixBatchFromArtRollouts(
      [await rollout(word, { advantage: 1, weight: 1, promptId: 0, logprob: () => -1 })],
      { normalizeAdvantages: false },
    );

  describe("resolveTrainingRun", () => {
    test("when a run is resolved without a name, then it is open at sequence 0 and learner version 0, and echoes its spec with seed null and run_name null", async () => {
      const run = await runs.resolve({ requestId: requestId("resolve"), spec: SPEC });
      expect(run).toEqual({
        run_id: expect.any(String),
        run_name: null,
        spec: SPEC,
        status: "open",
        next_sequence_id: 0,
        projected_learner_version: 0,
        committed_learner_version: 0,
      });
      expect(run.spec).toHaveProperty("seed", null);
      expect(await runs.get(run.run_id)).toEqual(run);
    });

    test("when the same request_id is resolved again, then the same run answers as it is now; with another body, 409 request_id_reused", async () => {
      const id = requestId("resolve");
      const first = await RunClient.resolve(runs, { requestId: id, spec: SPEC });
      await sftStep(first, await reversalBatch(["cat"]));
      const again = await runs.resolve({ requestId: id, spec: SPEC });
      expect(again.run_id).toBe(first.runId);
      expect(again.next_sequence_id).toBe(2);
      expect(again.committed_learner_version).toBe(1);
      await refused(
        runs.resolve({ requestId: id, spec: { ...SPEC, lora_rank: 8 } }),
        409,
        "request_id_reused",
      );
    });

    test("when a run_name is resolved under a new request_id, then the named run answers; with another spec, 409 run_name_conflict", async () => {
      const name = `nightly-${randomUUID()}`;
      const named = await runs.resolve({
        requestId: requestId("resolve"),
        spec: SPEC,
        runName: name,
      });
      expect(named.run_name).toBe(name);
      const found = await runs.resolve({
        requestId: requestId("resolve"),
        spec: SPEC,
        runName: name,
      });
      expect(found.run_id).toBe(named.run_id);
      await refused(
        runs.resolve({
          requestId: requestId("resolve"),
          spec: { ...SPEC, seed: 17 },
          runName: name,
        }),
        409,
        "run_name_conflict",
      );
    });

    test("when the base model is not served, then 400 unsupported_base_model; a W&B artifact as initial state 400 unsupported_checkpoint_source; an unknown saved state 404 checkpoint_not_found", async () => {
      await refused(
        runs.resolve({
          requestId: requestId("resolve"),
          spec: { ...SPEC, base_model: "Qwen/Qwen3-30B-A3B" },
        }),
        400,
        "unsupported_base_model",
      );
      await refused(
        runs.resolve({
          requestId: requestId("resolve"),
          spec: SPEC,
          initialState: {
            source: { kind: "wandb_artifact", artifact: "entity/project/checkpoint:v3" },
            restore_optimizer: false,
          },
        }),
        400,
        "unsupported_checkpoint_source",
      );
      await refused(
        runs.resolve({
          requestId: requestId("resolve"),
          spec: SPEC,
          initialState: {
            source: { kind: "service_checkpoint", checkpoint_id: randomUUID() },
            restore_optimizer: true,
          },
        }),
        404,
        "checkpoint_not_found",
      );
    });
  });

  describe("retrieveTrainingRun", () => {
    test("when another tenant's run or an unknown id is read, then 404", async () => {
      const run = await openRun();
      const tenant = await server.newTenant(`other-${randomUUID().slice(0, 8)}`);
      const theirs = new TrainingRuns(server.baseUrl, tenant.apiKey);
      const error = await theirs.get(run.runId).then(
        () => null,
        (err: unknown) => err,
      );
      expect(error).toMatchObject({ status: 404 });
      await expect(runs.get(randomUUID())).rejects.toMatchObject({ status: 404 });
    });
  });

  describe("createForwardBackwardOperation", () => {
    test("when a forward_backward is admitted, then its record is complete, runs admitted → running → succeeded, and its result is one ART takes", async () => {
      const run = await openRun();
      const batch = await reversalBatch(["cat", "sun"]);
      const op = await run.forwardBackward({
        requestId: requestId("fb"),
        batch,
        loss: CROSS_ENTROPY,
        returnTokenLogprobs: false,
      });
      expect(op.admitted).toMatchObject({
        run_id: run.runId,
        sequence_id: 0,
        kind: "forward_backward",
        learner_parent_version: 0,
        reserved_output_learner_version: null,
        cancel_requested: false,
        result_summary: null,
        error: null,
      });
      expect(["admitted", "running", "succeeded"]).toContain(op.admitted.status);
      const result = await op.result();
      // The statuses seen go forward only, and the cursor with them.
      const order = ["admitted", "running", "succeeded"];
      const seen = op.seen.map((o) => order.indexOf(o.status));
      expect(seen).toEqual([...seen].sort((a, b) => a - b));
      const cursors = op.seen.map((o) => o.latest_event_cursor);
      expect(cursors).toEqual([...cursors].sort((a, b) => a - b));
      const ended = op.seen.at(-1)!;
      expect(ended.started_at).not.toBeNull();
      expect(ended.ended_at).not.toBeNull();
      expect(ended.result_ref).toMatchObject({ media_type: "application/json" });
      const active = batch.matrices.reduce((n, m) => n + activePositions(m, false), 0);
      expect(result.training.accepted_trainable_tokens).toBe(active);
      expect(result.training.policy_token_counts).toBeNull();
      expect(result.produced_gradient).toBe(true);
      expect(result.loss).toEqual({
        contract_id: "cross_entropy_v1",
        value: expect.any(Number),
        reduction: "mean_active_token",
      });
      expect(result.loss.value).toBeGreaterThan(0);
      expect(result.token_logprobs).toEqual([]);
      expect(result.group_shapes).toEqual([]);
      expect(result.packing.logical_tokens).toBe(
        batch.matrices.reduce((n, m) => n + m.rows[0]!.shape[0]!, 0),
      );
    });

    test("when the same request_id and body come again, then the same operation answers and no sequence id is taken; other content under it is 409 request_id_reused", async () => {
      const run = await openRun();
      const body = forwardBody(0, {
        requestId: requestId("fb"),
        batch: await reversalBatch(["cat"]),
        loss: CROSS_ENTROPY,
      });
      const first = await runs.submit(run.runId, { kind: "forward_backward", body });
      const again = await runs.submit(run.runId, { kind: "forward_backward", body });
      expect(again.operation_id).toBe(first.operation_id);
      expect((await runs.get(run.runId)).next_sequence_id).toBe(1);
      const other = { ...body, return_token_logprobs: !body.return_token_logprobs };
      await refused(
        runs.submit(run.runId, { kind: "forward_backward", body: other }),
        409,
        "request_id_reused",
      );
      await refused(runs.submit(run.runId, { kind: "forward", body }), 409, "request_id_reused");
      expect((await runs.get(run.runId)).next_sequence_id).toBe(1);
    });

    test("when a sequence_id skips one or repeats one, then 409 sequence_gap and nothing is admitted", async () => {
      const run = await openRun();
      const batch = await reversalBatch(["cat"]);
      const at = (sequenceId: number) =>
        runs.submit(run.runId, {
          kind: "forward_backward",
          body: forwardBody(sequenceId, { requestId: requestId("fb"), batch, loss: CROSS_ENTROPY }),
        });
      const gap = await refused(at(1), 409, "sequence_gap");
      expect(gap.error.param).toBe("sequence_id");
      expect(gap.headers.get("x-should-retry")).toBe("false");
      expect((await at(0)).sequence_id).toBe(0);
      await refused(at(0), 409, "sequence_gap");
      await refused(at(2), 409, "sequence_gap");
      expect((await runs.get(run.runId)).next_sequence_id).toBe(1);
    });

    test("when 64 forward_backwards are open, then a 65th is 409 too_many_open_gradients until an optim_step consumes them", async () => {
      const run = await openRun();
      const batch = await reversalBatch(["cat"]);
      const open = [];
      for (let i = 0; i < 64; i++) {
        open.push(
          await run.forwardBackward({ requestId: requestId("fb"), batch, loss: CROSS_ENTROPY }),
        );
      }
      const body = forwardBody(64, { requestId: requestId("fb"), batch, loss: CROSS_ENTROPY });
      await refused(
        runs.submit(run.runId, { kind: "forward_backward", body }),
        409,
        "too_many_open_gradients",
      );
      const step = await (await run.optimStep(requestId("optim"), adam(1e-3))).result();
      expect(step.contributing_operation_ids).toEqual(open.map((o) => o.id));
      const next = await run.forwardBackward({
        requestId: requestId("fb"),
        batch,
        loss: CROSS_ENTROPY,
      });
      expect(next.admitted.learner_parent_version).toBe(1);
    });

    test("when a forward_backward fails (a loss that is not finite), then the run is failed and takes no more commands", async () => {
      const run = await openRun();
      // Behavior log-probs of −1000 make every importance ratio overflow: the loss is −∞.
      const batch = tokenMatrixBatchFromArtRollouts(
        [await rollout("cat", { advantage: 1, weight: 1, promptId: 0, logprob: () => -1000 })],
        { normalizeAdvantages: false },
      );
      const op = await run.forwardBackward({
        requestId: requestId("fb"),
        batch,
        loss: wireLoss("importance_sampling", { normalizeAdvantages: false }),
      });
      const error = await op.result().then(
        () => null,
        (err: unknown) => err,
      );
      expect(error).toBeInstanceOf(OperationFailed);
      const failed = (error as OperationFailed).operation;
      expect(failed.error).toEqual({ code: "execution_failed" });
      expect(failed.ended_at).not.toBeNull();
      expect(failed.result_ref).toBeNull();
      const state = await runs.get(run.runId);
      expect(state.status).toBe("failed");
      await refused(
        runs.submit(run.runId, {
          kind: "forward",
          body: forwardBody(1, {
            requestId: requestId("fwd"),
            batch: await reversalBatch(["cat"]),
            loss: CROSS_ENTROPY,
          }),
        }),
        409,
        "run_failed",
      );
      await refused(
        runs.submit(run.runId, {
          kind: "optim_step",
          body: { request_id: requestId("optim"), sequence_id: 1, optimizer: adam(1e-3) },
        }),
        409,
        "run_failed",
      );
      // An exact replay of what was admitted still answers its operation.
      const replay = await runs.submit(run.runId, {
        kind: "forward_backward",
        body: forwardBody(0, {
          requestId: op.admitted.request_id,
          batch,
          loss: wireLoss("importance_sampling", { normalizeAdvantages: false }),
        }),
      });
      expect(replay.operation_id).toBe(op.id);
    });
  });

  describe("createOptimStepOperation", () => {
    test("when no forward_backward is open, then 409 no_open_gradients; after two, one optim_step consumes both in order and makes learner version 1", async () => {
      const run = await openRun();
      const optimBody = (sequenceId: number) => ({
        kind: "optim_step" as const,
        body: { request_id: requestId("optim"), sequence_id: sequenceId, optimizer: adam(1e-3) },
      });
      await refused(runs.submit(run.runId, optimBody(0)), 409, "no_open_gradients");
      expect((await runs.get(run.runId)).next_sequence_id).toBe(0);
      const batch = await reversalBatch(["cat"]);
      const a = await run.forwardBackward({
        requestId: requestId("fb"),
        batch,
        loss: CROSS_ENTROPY,
      });
      const b = await run.forwardBackward({
        requestId: requestId("fb"),
        batch,
        loss: CROSS_ENTROPY,
      });
      const step = await run.optimStep(requestId("optim"), adam(1e-3));
      expect(step.admitted).toMatchObject({
        sequence_id: 2,
        learner_parent_version: 0,
        reserved_output_learner_version: 1,
      });
      const result = await step.result();
      expect(result.contributing_operation_ids).toEqual([a.id, b.id]);
      expect(result.learner_version).toBe(1);
      expect(result.checkpoint.learner_version).toBe(1);
      await refused(runs.submit(run.runId, optimBody(3)), 409, "no_open_gradients");
      expect(await runs.get(run.runId)).toMatchObject({
        next_sequence_id: 3,
        projected_learner_version: 1,
        committed_learner_version: 1,
      });
    });

    test("when commands of every kind are admitted, then each has the projected version as parent and only optim_step and load_state reserve the next", async () => {
      const run = await openRun();
      const batch = await reversalBatch(["cat"]);
      const fb1 = await run.forwardBackward({
        requestId: requestId("fb"),
        batch,
        loss: CROSS_ENTROPY,
      });
      const optim1 = await run.optimStep(requestId("optim"), adam(1e-3));
      const fwd = await run.forward({ requestId: requestId("fwd"), batch, loss: CROSS_ENTROPY });
      const save = await run.saveState({ requestId: requestId("save"), checkpointName: "one" });
      const fb2 = await run.forwardBackward({
        requestId: requestId("fb"),
        batch,
        loss: CROSS_ENTROPY,
      });
      const optim2 = await run.optimStep(requestId("optim"), adam(1e-3));
      const saved = await save.result();
      const load = await run.loadState({
        requestId: requestId("load"),
        checkpoint: saved.checkpoint.checkpoint_id,
      });
      const ops: [Operation, number, number | null][] = [
        [fb1.admitted, 0, null],
        [optim1.admitted, 0, 1],
        [fwd.admitted, 1, null],
        [save.admitted, 1, null],
        [fb2.admitted, 1, null],
        [optim2.admitted, 1, 2],
        [load.admitted, 2, 3],
      ];
      for (const [op, parent, reserved] of ops) {
        expect([op.kind, op.learner_parent_version, op.reserved_output_learner_version]).toEqual([
          op.kind,
          parent,
          reserved,
        ]);
      }
      expect((await optim2.result()).learner_version).toBe(2);
      const loaded = await load.result();
      expect(loaded.checkpoint.learner_version).toBe(3);
      expect(loaded.optimizer_restored).toBe(false);
      expect(await runs.get(run.runId)).toMatchObject({
        next_sequence_id: 7,
        projected_learner_version: 3,
        committed_learner_version: 3,
      });
    });
  });

  describe("createLoadStateOperation", () => {
    test("when the saved state is unknown, then 404 checkpoint_not_found; a W&B artifact 400 unsupported_checkpoint_source; with gradients open, 409 open_gradients", async () => {
      const run = await openRun();
      const batch = await reversalBatch(["cat"]);
      await sftStep(run, batch);
      const saved = await (
        await run.saveState({ requestId: requestId("save"), checkpointName: "one" })
      ).result();
      const load = (source: CheckpointSource) =>
        runs.submit(run.runId, {
          kind: "load_state",
          body: {
            request_id: requestId("load"),
            sequence_id: run.nextSequenceId,
            restore_optimizer: true,
            source,
          },
        });
      await refused(
        load({ kind: "service_checkpoint", checkpoint_id: randomUUID() }),
        404,
        "checkpoint_not_found",
      );
      await refused(
        load({ kind: "wandb_artifact", artifact: "entity/project/checkpoint:v3" }),
        400,
        "unsupported_checkpoint_source",
      );
      await run.forwardBackward({ requestId: requestId("fb"), batch, loss: CROSS_ENTROPY });
      await refused(
        load({ kind: "service_checkpoint", checkpoint_id: saved.checkpoint.checkpoint_id }),
        409,
        "open_gradients",
      );
      expect((await runs.get(run.runId)).next_sequence_id).toBe(4);
    });
  });

  describe("cancelTrainingOperation", () => {
    test("when a succeeded operation is cancelled, then 200 and the record is unchanged", async () => {
      const run = await openRun();
      const op = await finishedForward(run);
      const ended = await runs.operation(run.runId, op.id);
      expect(await op.cancel()).toEqual(ended);
      expect(await runs.operation(run.runId, op.id)).toEqual(ended);
      await expect(runs.cancel(run.runId, randomUUID())).rejects.toMatchObject({ status: 404 });
    });
  });

  describe("closeTrainingRun", () => {
    test("when a run is closed, then it ends closed, a new command is 409 run_closed, an exact replay still answers, and its operations stay readable", async () => {
      const run = await openRun();
      const batch = await reversalBatch(["cat"]);
      const body = forwardBody(0, { requestId: requestId("fwd"), batch, loss: CROSS_ENTROPY });
      const op = await runs.submit(run.runId, { kind: "forward", body });
      const closing = await run.close(requestId("close"));
      expect(["closing", "closed"]).toContain(closing.status);
      let state = closing;
      while (state.status === "closing") {
        await new Promise((resolve) => setTimeout(resolve, 100));
        state = await runs.get(run.runId);
      }
      expect(state.status).toBe("closed");
      await refused(
        runs.submit(run.runId, {
          kind: "forward",
          body: forwardBody(1, { requestId: requestId("fwd"), batch, loss: CROSS_ENTROPY }),
        }),
        409,
        "run_closed",
      );
      expect((await runs.submit(run.runId, { kind: "forward", body })).operation_id).toBe(
        op.operation_id,
      );
      expect((await runs.operation(run.runId, op.operation_id)).status).toBe("succeeded");
      expect(await runs.close(run.runId, requestId("close"))).toEqual(state);
    });
  });

  describe("retrieveTrainingOperationResult", () => {
    test("when a result is released, then the operation has no result_ref, the result is 404 result_not_found, and releasing again answers the same", async () => {
      const run = await openRun();
      const op = await finishedForward(run);
      const release = requestId("release");
      expect(await op.releaseResult(release)).toEqual({
        operation_id: op.id,
        request_id: release,
        released: true,
      });
      expect((await runs.operation(run.runId, op.id)).result_ref).toBeNull();
      await refused(runs.result(run.runId, op.id), 404, "result_not_found");
      expect((await op.releaseResult(release)).released).toBe(true);
    });
  });

  describe("releaseTrainingOperationResult", () => {
    test("when an unknown operation's result is released, then 404", async () => {
      const run = await openRun();
      await expect(
        runs.releaseResult(run.runId, randomUUID(), requestId("release")),
      ).rejects.toMatchObject({ status: 404 });
    });
  });

  describe("retrieveTrainingOperation", () => {
    test("when an unknown operation or one of another run is read, then 404", async () => {
      const [a, b] = [await openRun(), await openRun()];
      const op = await finishedForward(a);
      await expect(runs.operation(b.runId, op.id)).rejects.toMatchObject({ status: 404 });
      await expect(runs.operation(a.runId, randomUUID())).rejects.toMatchObject({ status: 404 });
    });
  });

  describe("createForwardOperation", () => {
    test("when a token id or a target is not below the vocabulary size, then 400 token_out_of_vocabulary and nothing is admitted", async () => {
      const run = await openRun();
      const { config } = await tinyModel();
      const matrix = onlyMatrix(await reversalBatch(["cat"]));
      const tokens = denseValues(matrix.rows[0]!) as number[];
      const targets = denseValues(matrix.rows[1]!) as number[];
      const T = tokens.length;
      for (const bad of [
        withRow(
          matrix,
          "token_ids",
          denseRow("token_ids", "int64", [T], [...tokens.slice(1), config.vocabSize]),
        ),
        withRow(
          matrix,
          "target_token_ids",
          denseRow(
            "target_token_ids",
            "int64",
            [T, 1],
            [config.vocabSize + 32, ...targets.slice(1)],
          ),
        ),
      ]) {
        await refused(
          run.forward({ requestId: requestId("fwd"), batch: batchOf([bad]), loss: CROSS_ENTROPY }),
          400,
          "token_out_of_vocabulary",
        );
      }
      expect((await runs.get(run.runId)).next_sequence_id).toBe(0);
    });

    test("when a matrix misses a row its loss needs, has an unknown row or the server's learner_logprobs, K ≠ 1 for cispo, or no active position, then 400 invalid_token_matrix", async () => {
      const run = await openRun();
      const policy = onlyMatrix(await policyBatch());
      const sft = onlyMatrix(await reversalBatch(["cat"]));
      const T = sft.rows[0]!.shape[0]!;
      const cispo = wireLoss("cispo", { normalizeAdvantages: false, clipLow: 0, clipHigh: 5 });
      const cases: [TokenMatrix, typeof cispo][] = [
        [withRow(policy, "advantages", null), cispo],
        [withRow(sft, "loss_weights", null), CROSS_ENTROPY],
        [
          withRow(sft, "reward", denseRow("reward", "float32", [T, 1], Array(T).fill(1))),
          CROSS_ENTROPY,
        ],
        [
          withRow(
            sft,
            "learner_logprobs",
            denseRow("learner_logprobs", "float32", [T, 1], Array(T).fill(-1)),
          ),
          CROSS_ENTROPY,
        ],
        [widen(policy), cispo],
        [
          withRow(
            sft,
            "loss_weights",
            denseRow("loss_weights", "float32", [T, 1], Array(T).fill(0)),
          ),
          CROSS_ENTROPY,
        ],
        [
          withRow(
            sft,
            "loss_weights",
            denseRow("loss_weights", "float32", [T + 1, 1], Array(T + 1).fill(1)),
          ),
          CROSS_ENTROPY,
        ],
        [
          withRow(sft, "token_ids", denseRow("token_ids", "int32", [T], denseValues(sft.rows[0]!))),
          CROSS_ENTROPY,
        ],
      ];
      for (const [matrix, loss] of cases) {
        await refused(
          run.forward({ requestId: requestId("fwd"), batch: batchOf([matrix]), loss }),
          400,
          "invalid_token_matrix",
        );
      }
      // Two matrices under one id.
      await refused(
        run.forward({
          requestId: requestId("fwd"),
          batch: batchOf([sft, sft]),
          loss: CROSS_ENTROPY,
        }),
        400,
        "invalid_token_matrix",
      );
      expect((await runs.get(run.runId)).next_sequence_id).toBe(0);
    });

    test("when the loss is dpo, or clip thresholds come with another loss than cispo or low above high, then 400", async () => {
      const run = await openRun();
      const sft = await reversalBatch(["cat"]);
      const policy = await policyBatch();
      await refused(
        run.forward({ requestId: requestId("fwd"), batch: sft, loss: wireLoss("dpo") }),
        400,
        "unsupported_loss",
      );
      await refused(
        run.forward({
          requestId: requestId("fwd"),
          batch: sft,
          loss: { ...CROSS_ENTROPY, clip_low_threshold: 0.2 },
        }),
        400,
        "invalid_loss_options",
      );
      await refused(
        run.forward({
          requestId: requestId("fwd"),
          batch: policy,
          loss: wireLoss("cispo", { clipLow: 3, clipHigh: 1 }),
        }),
        400,
        "invalid_loss_options",
      );
    });

    test("when a matrix is longer than the base model's context, then 400 context_length_exceeded", async () => {
      const run = await openRun();
      const { config } = await tinyModel();
      const T = config.maxPositions + 1;
      const matrix: TokenMatrix = {
        kind: "matrix",
        matrix_id: "long",
        packing_affinity_id: null,
        rows: [
          denseRow("token_ids", "int64", [T], Array(T).fill(12)),
          denseRow("target_token_ids", "int64", [T, 1], Array(T).fill(12)),
          denseRow("loss_weights", "float32", [T, 1], Array(T).fill(1)),
        ],
      };
      await refused(
        run.forward({ requestId: requestId("fwd"), batch: batchOf([matrix]), loss: CROSS_ENTROPY }),
        400,
        "context_length_exceeded",
      );
    });

    test("when rows come as spans, then the loss is the one their dense values give; each matrix's learner log-probs have its targets' shape, two per position for cross-entropy", async () => {
      const run = await openRun();
      const batch = await policyBatch("sun");
      const matrix = onlyMatrix(batch);
      expect(matrix.rows.filter((r) => r.values.encoding === "spans").map((r) => r.name)).toEqual([
        "loss_weights",
        "advantages",
        "behavior_logprobs",
      ]);
      const dense: TokenMatrix = {
        ...matrix,
        rows: matrix.rows.map((r) => denseRow(r.name, r.dtype, r.shape, denseValues(r))),
      };
      const loss = wireLoss("cispo", { normalizeAdvantages: false, clipLow: 0, clipHigh: 5 });
      const viaSpans = await (
        await run.forwardBackward({ requestId: requestId("fb"), batch, loss })
      ).result();
      const viaDense = await (
        await run.forwardBackward({ requestId: requestId("fb"), batch: batchOf([dense]), loss })
      ).result();
      expect(viaSpans.training.accepted_trainable_tokens).toBe(activePositions(matrix, true));
      expect(viaDense.training).toEqual(viaSpans.training);
      expect(viaDense.loss).toEqual(viaSpans.loss);
      expect(viaDense.token_logprobs).toEqual(viaSpans.token_logprobs);
      const [logprobs] = viaSpans.token_logprobs;
      expect(logprobs!.matrix_id).toBe(matrix.matrix_id);
      expect(logprobs!.shape).toEqual(matrix.rows[1]!.shape);
      const values = logprobValues(logprobs!);
      expect(values).toHaveLength(matrix.rows[0]!.shape[0]!);
      expect(values.every((v) => Number.isFinite(v) && v <= 0)).toBe(true);
      const wide = widen(onlyMatrix(await reversalBatch(["sun"])));
      const forward = await (
        await run.forward({
          requestId: requestId("fwd"),
          batch: batchOf([wide]),
          loss: CROSS_ENTROPY,
        })
      ).result();
      expect(forward.token_logprobs.map((t) => t.shape)).toEqual([wide.rows[1]!.shape]);
      expect(logprobValues(forward.token_logprobs[0]!)).toHaveLength(2 * wide.rows[0]!.shape[0]!);
    });
  });
});
