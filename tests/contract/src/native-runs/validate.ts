import { Ajv2020, type ValidateFunction } from "ajv/dist/2020.js";
import type {
  NativeTrainingRun,
  Operation,
  OperationKind,
  OperationResult,
  PackingOutcome,
  ResultRelease,
  TokenLogprobs,
} from "./wire.ts";

/**
 * What ART's client checks of each answer, so a test fails where ART would. The shapes are JSON
 * Schemas of ART's pydantic models (`art.serverless.client`, `art.training`); the rules after
 * them are the models' validators. ART reads a result twice: as `_PublicTrainingResult` (one
 * closed model, every field optional), then, translated by kind, as its contract type
 * (ForwardResult, …), whose `extra="forbid"` refuses every key of another kind, even one sent as
 * null.
 */
export class ArtContractError extends Error {
  override name = "ArtContractError";
}

const KINDS: OperationKind[] = [
  "forward",
  "forward_backward",
  "optim_step",
  "save_weights_for_sampler",
  "save_state",
  "load_state",
];
/** `CheckpointArchiveRef.wandb_artifact`'s pattern. */
const ARTIFACT =
  "^[^/:\\\\\\x00-\\x1f]+/[^/:\\\\\\x00-\\x1f]+/[^/:\\\\\\x00-\\x1f]+:v(?:0|[1-9][0-9]*)$";

type Schema = Record<string, unknown>;
const int = (minimum?: number): Schema => ({
  type: "integer",
  ...(minimum === undefined ? {} : { minimum }),
});
const str = (minLength = 0, maxLength?: number): Schema => ({
  type: "string",
  minLength,
  ...(maxLength === undefined ? {} : { maxLength }),
});
const nullable = (schema: Schema): Schema => ({ anyOf: [schema, { type: "null" }] });
const array = (items: Schema, minItems = 0, maxItems?: number): Schema => ({
  type: "array",
  items,
  minItems,
  ...(maxItems === undefined ? {} : { maxItems }),
});
/** A pydantic model with `extra="forbid"`: `required` are the fields without a default. */
const closed = (
  properties: Record<string, Schema>,
  required = Object.keys(properties),
): Schema => ({
  type: "object",
  additionalProperties: false,
  properties,
  required,
});

const packing = closed({
  packed_sequence_length: int(1),
  packed_sequences: int(0),
  target_packed_sequences: int(1),
  logical_tokens: int(0),
  physical_tokens: int(0),
  packed_capacity_tokens: int(0),
  padding_tokens: int(0),
});
const tokenLogprobs = closed({
  matrix_id: str(1, 255),
  shape: array({ type: "integer" }, 1, 2),
  data: str(),
});
const groupShape = closed({
  leaves: array(
    closed({
      matrix_id: str(1, 255),
      token_ids: array(int(), 1),
      shareable_length: int(0),
    }),
    1,
  ),
});
const checkpoint = closed({ checkpoint_id: str(), learner_version: int(0) });
const training = closed({
  accepted_trainable_tokens: int(0),
  policy_token_counts: nullable(
    array(closed({ policy_version: int(0), accepted_trainable_tokens: int(1) })),
  ),
});
const loss = closed(
  {
    contract_id: { enum: ["cross_entropy_v1", "importance_sampling_v1", "cispo_v1", "dpo_v1"] },
    value: { type: "number" },
    reduction: { const: "mean_active_token" },
  },
  ["contract_id", "value"],
);
const archive = closed({
  checkpoint_id: str(1, 2048),
  learner_version: int(0),
  components: array({ enum: ["weights", "optimizer"] }, 1, 2),
  wandb_artifact: { ...str(5, 768), pattern: ARTIFACT },
});
const publicResult = closed(
  {
    operation_id: str(),
    kind: { enum: KINDS },
    metrics: { type: "object", additionalProperties: { type: "number" } },
    packing: nullable(packing),
    training: nullable(training),
    loss: nullable(loss),
    produced_gradient: nullable({ type: "boolean" }),
    token_logprobs: array(tokenLogprobs),
    group_shapes: array(groupShape),
    packed_input: nullable(
      closed(
        {
          capture_id: str(),
          manifest_sha256: str(),
          content_sha256: nullable(str()),
          input_object: {},
        },
        ["capture_id", "manifest_sha256", "content_sha256"],
      ),
    ),
    contributing_operation_ids: nullable(array(str())),
    checkpoint: nullable(checkpoint),
    learner_version: nullable(int(0)),
    target: nullable({ enum: ["active", "saved_generation"] }),
    model_alias: nullable(str()),
    generation_id: nullable(str()),
    archive: nullable(archive),
    optimizer_restored: nullable({ type: "boolean" }),
  },
  ["operation_id", "kind"],
);
const timestamp = str(1);
const publicOperation = closed({
  operation_id: str(),
  run_id: str(),
  request_id: str(),
  sequence_id: int(),
  kind: { enum: KINDS },
  status: { enum: ["admitted", "running", "succeeded", "failed", "cancelled"] },
  learner_parent_version: int(),
  reserved_output_learner_version: nullable(int()),
  admitted_at: timestamp,
  started_at: nullable(timestamp),
  ended_at: nullable(timestamp),
  cancel_requested: { type: "boolean" },
  latest_event_cursor: int(),
  result_summary: nullable(publicResult),
  result_ref: nullable(
    closed({
      result_id: str(),
      media_type: {
        enum: ["application/json", "application/vnd.coreweave.training-result+msgpack; version=1"],
      },
      size_bytes: int(1),
      expires_at: timestamp,
    }),
  ),
  error: nullable(closed({ code: str() })),
});
/** `NativeTrainingRun` is an openai `BaseModel`: not closed, and `run_name` defaults to None. */
const run: Schema = {
  type: "object",
  required: [
    "run_id",
    "spec",
    "status",
    "next_sequence_id",
    "projected_learner_version",
    "committed_learner_version",
  ],
  properties: {
    run_id: str(),
    run_name: nullable(str()),
    spec: { type: "object" },
    status: { enum: ["open", "closing", "closed", "failed"] },
    next_sequence_id: int(),
    projected_learner_version: int(),
    committed_learner_version: int(),
  },
};
const release: Schema = {
  type: "object",
  required: ["operation_id", "request_id", "released"],
  properties: { operation_id: str(), request_id: str(), released: { const: true } },
};

const ajv = new Ajv2020({ allErrors: true, strict: false });
const compiled = {
  run: ajv.compile(run),
  operation: ajv.compile(publicOperation),
  result: ajv.compile(publicResult),
  release: ajv.compile(release),
};

function shaped<T>(validate: ValidateFunction, value: unknown, what: string): T {
  if (!validate(value)) {
    throw new ArtContractError(`${what}: ${ajv.errorsText(validate.errors)} in ${brief(value)}`);
  }
  return value as T;
}

function brief(value: unknown): string {
  return JSON.stringify(value).slice(0, 600);
}

function fail(message: string): never {
  throw new ArtContractError(message);
}

/**
 * The keys each kind's ART contract type takes after translation (`_result_payload`), and those
 * it needs not null. Any other key present (null included) is "Extra inputs are not permitted".
 */
const RESULT_KEYS: Record<OperationKind, { allowed: string[]; required: string[] }> = {
  forward: {
    allowed: ["metrics", "packing", "token_logprobs", "group_shapes", "packed_input"],
    required: ["packing"],
  },
  forward_backward: {
    allowed: [
      "metrics",
      "packing",
      "token_logprobs",
      "group_shapes",
      "packed_input",
      "training",
      "loss",
      "produced_gradient",
    ],
    required: ["packing", "training", "loss"],
  },
  optim_step: {
    allowed: ["metrics", "contributing_operation_ids", "checkpoint", "learner_version"],
    required: ["contributing_operation_ids", "checkpoint", "learner_version"],
  },
  save_weights_for_sampler: {
    allowed: ["metrics", "target", "model_alias", "generation_id", "learner_version", "checkpoint"],
    required: ["target", "model_alias", "generation_id", "learner_version", "checkpoint"],
  },
  save_state: { allowed: ["metrics", "checkpoint", "archive"], required: ["checkpoint"] },
  load_state: {
    allowed: ["metrics", "checkpoint", "optimizer_restored"],
    required: ["checkpoint", "optimizer_restored"],
  },
};

/** `PackingOutcome._validate_counts`. */
export function checkPacking(p: PackingOutcome): void {
  if (p.packed_capacity_tokens !== p.packed_sequences * p.packed_sequence_length)
    fail(`packed capacity does not match shape: ${brief(p)}`);
  if (p.physical_tokens > p.logical_tokens)
    fail(`physical tokens cannot exceed logical tokens: ${brief(p)}`);
  if (p.physical_tokens > p.packed_capacity_tokens)
    fail(`physical tokens cannot exceed packed capacity: ${brief(p)}`);
  if (p.padding_tokens !== p.packed_capacity_tokens - p.physical_tokens)
    fail(`padding tokens must equal capacity minus physical tokens: ${brief(p)}`);
  if ((p.packed_sequences === 0) !== (p.logical_tokens === 0))
    fail(`zero packed sequences and logical tokens must agree: ${brief(p)}`);
}

/** `TokenLogprobs._validate_buffer`. */
function checkTokenLogprobs(t: TokenLogprobs): void {
  if (t.shape.some((d) => d < 0)) fail("token logprob dimensions cannot be negative");
  if (t.shape.length === 2 && t.shape[1]! < 1)
    fail("token logprob candidate width must be positive");
  const count = t.shape.reduce((a, b) => a * b, 1);
  if (Buffer.from(t.data, "base64").length !== count * 4)
    fail(`token logprob buffer size differs from its shape ${JSON.stringify(t.shape)}`);
}

/** A result as ART's `TrainingRuns.result` and the translation to its contract type take it. */
export function checkResult(
  value: unknown,
  expected?: { operationId: string; kind: OperationKind },
): OperationResult {
  const result = shaped<Record<string, unknown> & OperationResult>(
    compiled.result,
    value,
    "public training result",
  );
  const { kind } = result;
  const keys = RESULT_KEYS[kind];
  const extra = Object.keys(result).filter(
    (k) => k !== "operation_id" && k !== "kind" && !keys.allowed.includes(k),
  );
  if (extra.length > 0) fail(`${kind} result: Extra inputs are not permitted: ${extra.join(", ")}`);
  const missing = keys.required.filter((k) => result[k] === undefined || result[k] === null);
  if (missing.length > 0) fail(`${kind} result has no ${missing.join(", ")}`);
  if (kind === "save_state" && !("archive" in result))
    fail("public save-state result has no archive");
  if (result.operation_id.length > 64) fail("result operation_id is longer than 64 characters");
  if (expected && (result.operation_id !== expected.operationId || kind !== expected.kind))
    fail("operation result identity changed");
  switch (result.kind) {
    case "forward":
    case "forward_backward": {
      checkPacking(result.packing);
      for (const t of result.token_logprobs ?? []) checkTokenLogprobs(t);
      if (result.kind === "forward_backward") {
        const { accepted_trainable_tokens: accepted, policy_token_counts: counts } =
          result.training;
        if (counts) {
          const versions = counts.map((c) => c.policy_version);
          const sorted = [...new Set(versions)].sort((a, b) => a - b);
          if (versions.join() !== sorted.join())
            fail("policy token counts must be sorted and unique");
          if (counts.reduce((n, c) => n + c.accepted_trainable_tokens, 0) !== accepted)
            fail("policy token counts must cover accepted trainable tokens");
        }
        const produced = (result as { produced_gradient?: boolean }).produced_gradient ?? true;
        if (produced !== accepted > 0) fail("gradient production must match loss-bearing tokens");
        if (!produced && (result.token_logprobs ?? []).length > 0)
          fail("zero-work F/B cannot retain input or token outputs");
      }
      break;
    }
    case "optim_step":
      if (result.contributing_operation_ids.length < 1)
        fail("an optimizer result needs at least one contributing operation");
      if (result.learner_version !== result.checkpoint.learner_version)
        fail("public optimizer learner version changed");
      break;
    case "save_weights_for_sampler":
      for (const field of [result.model_alias, result.generation_id])
        if (field.length < 1 || field.length > 255)
          fail("sampler identity is not 1–255 characters");
      if (result.learner_version !== result.checkpoint.learner_version)
        fail("public sampler learner version changed");
      break;
    case "save_state":
      if (
        result.archive &&
        (result.archive.checkpoint_id !== result.checkpoint.checkpoint_id ||
          result.archive.learner_version !== result.checkpoint.learner_version)
      )
        fail("durable archive differs from its checkpoint");
      break;
    case "load_state":
      break;
  }
  return result;
}

function instant(text: string, field: string): number {
  if (!/(Z|[+-]\d\d:?\d\d)$/.test(text)) fail(`${field} has no time zone: ${text}`);
  const ms = Date.parse(text);
  if (!Number.isFinite(ms)) fail(`${field} is not a date-time: ${text}`);
  return ms;
}

/** An operation as ART's `TrainingRuns.operation` and `_operation_ref` take it. */
export function checkOperation(value: unknown): Operation {
  const op = shaped<Operation>(compiled.operation, value, "public training operation");
  if (op.result_summary !== null) {
    const summary = checkResult(op.result_summary);
    if (summary.kind !== op.kind) fail("public operation result kind changed");
  }
  // NativeTrainingOperation._validate_execution_timeline
  const admitted = instant(op.admitted_at, "admitted_at");
  const started = op.started_at === null ? null : instant(op.started_at, "started_at");
  const ended = op.ended_at === null ? null : instant(op.ended_at, "ended_at");
  if (started !== null && started < admitted) fail("operation execution starts before admission");
  if (ended !== null && ended < (started ?? admitted))
    fail("operation execution ends before it starts");
  // OperationRef
  if (op.operation_id.length < 1 || op.operation_id.length > 64)
    fail(`operation_id must be 1–64 characters: ${op.operation_id}`);
  if (op.run_id.length < 1 || op.run_id.length > 255) fail("run_id must be 1–255 characters");
  if (op.sequence_id < 0 || op.learner_parent_version < 0) fail("negative sequence or version");
  const transition = op.kind === "optim_step" || op.kind === "load_state";
  if (transition !== (op.reserved_output_learner_version !== null))
    fail("learner transitions must reserve an output version");
  if (transition && op.reserved_output_learner_version !== op.learner_parent_version + 1)
    fail("learner transitions must advance exactly one version");
  return op;
}

export function checkRun(value: unknown): NativeTrainingRun {
  const parsed = shaped<NativeTrainingRun>(compiled.run, value, "native training run");
  return { ...parsed, run_name: parsed.run_name ?? null };
}

export function checkRelease(value: unknown): ResultRelease {
  return shaped<ResultRelease>(compiled.release, value, "result release");
}
