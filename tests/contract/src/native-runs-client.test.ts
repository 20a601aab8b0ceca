import { describe, expect, it } from "vitest";
import {
  coefficientRow,
  denseValues,
  tokenMatrixBatchFromArtRollouts,
  tokenMatrixBatchFromSft,
} from "./native-runs/token-matrix.ts";
import { ArtContractError, checkOperation, checkResult } from "./native-runs/validate.ts";

/**
 * The native-runs client holds the server to what ART's client checks, and builds batches as
 * ART lowers its data: these cases pin that, with no server.
 */
const packing = {
  packed_sequence_length: 8,
  packed_sequences: 1,
  target_packed_sequences: 1,
  logical_tokens: 7,
  physical_tokens: 7,
  packed_capacity_tokens: 8,
  padding_tokens: 1,
};
const forward = {
  operation_id: "operation-0",
  kind: "forward",
  metrics: { loss: 1 },
  packing,
  token_logprobs: [],
  group_shapes: [],
};
const fb = {
  ...forward,
  kind: "forward_backward",
  training: {
    accepted_trainable_tokens: 4,
    policy_token_counts: [{ policy_version: 0, accepted_trainable_tokens: 4 }],
  },
  loss: { contract_id: "cispo_v1", value: 0.25, reduction: "mean_active_token" },
  produced_gradient: true,
};
const operation = {
  operation_id: "operation-2",
  run_id: "run-native",
  request_id: "optimizer",
  sequence_id: 2,
  kind: "optim_step",
  status: "succeeded",
  learner_parent_version: 0,
  reserved_output_learner_version: 1,
  admitted_at: "2026-09-02T00:00:00Z",
  started_at: "2026-09-02T00:00:00Z",
  ended_at: "2026-09-02T00:00:01Z",
  cancel_requested: false,
  latest_event_cursor: 3,
  result_summary: null,
  result_ref: {
    result_id: "operation-2",
    media_type: "application/json",
    size_bytes: 1,
    expires_at: "2026-09-03T00:00:00Z",
  },
  error: null,
};

describe("the native-runs client's checks", () => {
  it("when results are as ART's own tests send them, then each kind passes", () => {
    const checkpoint = { checkpoint_id: "checkpoint-1", learner_version: 1 };
    for (const result of [
      forward,
      fb,
      {
        operation_id: "o",
        kind: "optim_step",
        metrics: {},
        contributing_operation_ids: ["operation-1"],
        checkpoint,
        learner_version: 1,
      },
      {
        operation_id: "o",
        kind: "save_weights_for_sampler",
        metrics: {},
        target: "saved_generation",
        model_alias: "sampler",
        generation_id: "generation-1",
        learner_version: 1,
        checkpoint,
      },
      {
        operation_id: "o",
        kind: "save_state",
        metrics: {},
        checkpoint,
        archive: {
          ...checkpoint,
          components: ["weights", "optimizer"],
          wandb_artifact: "entity/project/checkpoint:v1",
        },
      },
      { operation_id: "o", kind: "load_state", metrics: {}, checkpoint, optimizer_restored: true },
    ]) {
      expect(() => checkResult(result), result.kind).not.toThrow();
    }
  });

  it("when a result has a key ART does not know, or one of another kind even as null, then it is refused", () => {
    expect(() => checkResult({ ...forward, physical_lora_locator: "private" })).toThrow(
      ArtContractError,
    );
    expect(() => checkResult({ ...forward, training: null })).toThrow(/Extra inputs/);
    expect(() => checkResult({ ...fb, checkpoint: null })).toThrow(/Extra inputs/);
    const { archive: _, ...noArchive } = {
      operation_id: "o",
      kind: "save_state",
      metrics: {},
      checkpoint: { checkpoint_id: "c", learner_version: 0 },
      archive: null,
    };
    expect(() => checkResult(noArchive)).toThrow(/no archive/);
  });

  it("when packing, gradient or version arithmetic is off, then the result is refused", () => {
    expect(() => checkResult({ ...forward, packing: { ...packing, padding_tokens: 0 } })).toThrow(
      /padding/,
    );
    expect(() =>
      checkResult({
        ...forward,
        packing: { ...packing, packed_capacity_tokens: 9, padding_tokens: 2 },
      }),
    ).toThrow(/capacity/);
    expect(() => checkResult({ ...fb, produced_gradient: false })).toThrow(/gradient/);
    expect(() =>
      checkResult({
        ...fb,
        training: {
          ...fb.training,
          policy_token_counts: [{ policy_version: 0, accepted_trainable_tokens: 3 }],
        },
      }),
    ).toThrow(/cover/);
    expect(() =>
      checkResult({
        operation_id: "o",
        kind: "optim_step",
        metrics: {},
        contributing_operation_ids: ["a"],
        checkpoint: { checkpoint_id: "c", learner_version: 2 },
        learner_version: 1,
      }),
    ).toThrow(/learner version changed/);
  });

  it("when an operation lacks a nullable field, reserves a version it should not, ends before it starts, or has an id over 64 characters, then it is refused", () => {
    expect(() => checkOperation(operation)).not.toThrow();
    const { started_at: _, ...missing } = operation;
    expect(() => checkOperation(missing)).toThrow(/started_at/);
    expect(() => checkOperation({ ...operation, kind: "forward_backward" })).toThrow(/reserve/);
    expect(() => checkOperation({ ...operation, reserved_output_learner_version: 2 })).toThrow(
      /exactly one/,
    );
    expect(() => checkOperation({ ...operation, ended_at: "2026-09-01T00:00:00Z" })).toThrow(
      /ends before/,
    );
    expect(() => checkOperation({ ...operation, operation_id: "x".repeat(65) })).toThrow(/64/);
  });
});

describe("the native-runs lowering", () => {
  it("when SFT examples are lowered, then each position targets the next label (0 where none), weighted 1 where there is one, and an example without labels is left out", () => {
    const batch = tokenMatrixBatchFromSft([
      { inputIds: [5, 6, 7, 8], labels: [-100, -100, 7, 8] },
      { inputIds: [5, 6], labels: [-100, -100] },
    ])!;
    expect(batch.matrices.map((m) => m.matrix_id)).toEqual(["sft-0"]);
    const [tokens, targets, weights] = batch.matrices[0]!.rows;
    expect(denseValues(tokens!)).toEqual([5, 6, 7, 8]);
    expect(targets!.shape).toEqual([4, 1]);
    expect(denseValues(targets!)).toEqual([0, 7, 8, 0]);
    expect(denseValues(weights!)).toEqual([0, 1, 1, 0]);
    expect(tokenMatrixBatchFromSft([{ inputIds: [1], labels: [-100] }])).toBeNull();
  });

  it("when a coefficient row is mostly one run, then it is spans over 0; when spans would not be shorter, dense", () => {
    const long = coefficientRow("loss_weights", [0, 0, 1, 1, 1, 1, 1, 0]);
    expect(long.values).toEqual({
      encoding: "spans",
      default: [0],
      spans: [{ start: 2, end: 7, value: [1] }],
    });
    expect(denseValues(long)).toEqual([0, 0, 1, 1, 1, 1, 1, 0]);
    expect(coefficientRow("advantages", [1, 2, 3]).values.encoding).toBe("dense");
  });

  it("when rollouts are lowered, then weights are over their active mean, advantages over the mean |A|·w, behavior log-probs shifted, and known versions a policy_version row", () => {
    const batch = tokenMatrixBatchFromArtRollouts([
      {
        tokenIds: [1, 2, 3, 4],
        assistantMask: [0, 0, 1, 1],
        logprobs: [Number.NaN, Number.NaN, -0.5, -0.25],
        advantage: 2,
        weight: 1,
        promptId: 3,
        policyVersions: [-1, -1, 0, 0],
      },
      {
        tokenIds: [1, 2, 5],
        assistantMask: [0, 0, 1],
        logprobs: [Number.NaN, Number.NaN, -1],
        advantage: -1,
        weight: 3,
        promptId: 3,
      },
    ]);
    const [a, b] = batch.matrices;
    /** A matrix's rows written out, to 6 decimals. */
    const rows = (m: typeof a) =>
      Object.fromEntries(
        m!.rows.map((r) => [r.name, denseValues(r).map((v) => Number(Number(v).toFixed(6)))]),
      );
    // Active positions: a at 1, 2 (weights 1, 1); b at 1 (weight 3): mean weight 5/3.
    expect(rows(a).target_token_ids).toEqual([2, 3, 4, 0]);
    expect(rows(a).loss_weights).toEqual([0, 0.6, 0.6, 0]);
    expect(rows(b).loss_weights).toEqual([0, 1.8, 0]);
    // The mean |A|·w is (2·0.6 + 2·0.6 + 1·1.8) / 3 = 1.4.
    expect(rows(a).advantages).toEqual([0, 1.428571, 1.428571, 0]);
    expect(rows(b).advantages).toEqual([0, -0.714286, 0]);
    expect(rows(a).behavior_logprobs).toEqual([0, -0.5, -0.25, 0]);
    expect(rows(a).policy_version).toEqual([-1, 0, 0, -1]);
    expect(rows(b).policy_version).toBeUndefined();
    expect(a!.packing_affinity_id).toBe("prompt-3");
  });
});
