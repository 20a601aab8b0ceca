/**
 * The native training API's wire, as OpenPipe ART's `art.serverless.client.TrainingRuns`
 * sends and reads it, written from ART's code and independent of Arbor's spec and server: the
 * contract tests hold the server to what ART's client does, not to what our spec says.
 */

export type RunStatus = "open" | "closing" | "closed" | "failed";
export type OperationKind =
  | "forward"
  | "forward_backward"
  | "optim_step"
  | "save_weights_for_sampler"
  | "save_state"
  | "load_state";
export type OperationStatus = "admitted" | "running" | "succeeded" | "failed" | "cancelled";
export const TERMINAL: ReadonlySet<OperationStatus> = new Set(["succeeded", "failed", "cancelled"]);

/** ART's `TrainingRunSpec` as it flattens it onto the wire (target modules sorted). */
export interface WireRunSpec {
  base_model: string;
  dtype: "bfloat16";
  lora_rank: number;
  lora_target_modules: string[];
  seed: number | null;
}

export type CheckpointSource =
  | { kind: "service_checkpoint"; checkpoint_id: string }
  | { kind: "wandb_artifact"; artifact: string };

export interface RunInitialState {
  source: CheckpointSource;
  restore_optimizer: boolean;
}

/** ART's `NativeTrainingRun`. */
export interface NativeTrainingRun {
  run_id: string;
  run_name: string | null;
  spec: Record<string, unknown>;
  status: RunStatus;
  next_sequence_id: number;
  projected_learner_version: number;
  committed_learner_version: number;
}

// TokenMatrix (`art.training.token_matrix`).
export type RowDType = "bool" | "int32" | "int64" | "float32";
export type RowScalar = number | boolean;
export type RowElement = RowScalar | RowScalar[];
export interface SpanValue {
  start: number;
  end: number;
  value: RowElement;
}
export type RowValues =
  | { encoding: "dense"; data: RowScalar[] }
  | { encoding: "spans"; default: RowElement; spans: SpanValue[] };
export interface TokenRow {
  name: string;
  dtype: RowDType;
  shape: number[];
  values: RowValues;
}
export interface TokenMatrix {
  kind: "matrix";
  matrix_id: string;
  packing_affinity_id: string | null;
  rows: TokenRow[];
}
export interface TokenMatrixBatch {
  kind: "token_matrix";
  matrices: TokenMatrix[];
  routes: unknown[];
}

export type LossName = "cross_entropy" | "importance_sampling" | "cispo" | "dpo";
/** The loss as `_NativePublicWireAdapter` flattens `NamedLossRequest`: clip values for CISPO
 * only. */
export interface WireLoss {
  name: LossName;
  normalize_advantages: boolean;
  clip_low_threshold?: number;
  clip_high_threshold?: number;
}

/** The command bodies: `request.model_dump(mode="json", exclude={"run_id"})`, every default
 * written. */
export interface ForwardBody {
  request_id: string;
  sequence_id: number;
  batch: TokenMatrixBatch;
  loss: WireLoss;
  collect_packing_shapes: boolean;
  retain_packed_input: boolean;
  return_token_logprobs: boolean;
}
export interface AdamConfig {
  learning_rate: number;
  beta1: number;
  beta2: number;
  eps: number;
  weight_decay: number;
  grad_clip_norm: number;
}
export interface OptimStepBody {
  request_id: string;
  sequence_id: number;
  optimizer: AdamConfig;
}
export interface SaveWeightsForSamplerBody {
  request_id: string;
  sequence_id: number;
  checkpoint_name: string;
  ttl_seconds: number | null;
  publication: { target: "active" | "saved_generation"; model_alias: string };
}
export interface SaveStateBody {
  request_id: string;
  sequence_id: number;
  checkpoint_name: string;
  ttl_seconds: number | null;
  overwrite: boolean;
}
export interface LoadStateBody {
  request_id: string;
  sequence_id: number;
  restore_optimizer: boolean;
  source: CheckpointSource;
}

/** One command: its kind (the path's last segment) and its body. */
export type Command =
  | { kind: "forward" | "forward_backward"; body: ForwardBody }
  | { kind: "optim_step"; body: OptimStepBody }
  | { kind: "save_weights_for_sampler"; body: SaveWeightsForSamplerBody }
  | { kind: "save_state"; body: SaveStateBody }
  | { kind: "load_state"; body: LoadStateBody };

/** ART's `_PublicTrainingOperation`: every field required, the nullable ones present. */
export interface Operation {
  operation_id: string;
  run_id: string;
  request_id: string;
  sequence_id: number;
  kind: OperationKind;
  status: OperationStatus;
  learner_parent_version: number;
  reserved_output_learner_version: number | null;
  admitted_at: string;
  started_at: string | null;
  ended_at: string | null;
  cancel_requested: boolean;
  latest_event_cursor: number;
  result_summary: Record<string, unknown> | null;
  result_ref: {
    result_id: string;
    media_type: string;
    size_bytes: number;
    expires_at: string;
  } | null;
  error: { code: string } | null;
}

export interface PackingOutcome {
  packed_sequence_length: number;
  packed_sequences: number;
  target_packed_sequences: number;
  logical_tokens: number;
  physical_tokens: number;
  packed_capacity_tokens: number;
  padding_tokens: number;
}
export interface TokenLogprobs {
  matrix_id: string;
  shape: number[];
  /** Base64 of little-endian float32 values. */
  data: string;
}
export interface CheckpointRef {
  checkpoint_id: string;
  learner_version: number;
}
interface ResultBase {
  operation_id: string;
  metrics: Record<string, number>;
}
export interface ForwardResult extends ResultBase {
  kind: "forward";
  packing: PackingOutcome;
  token_logprobs: TokenLogprobs[];
  group_shapes: unknown[];
}
export interface ForwardBackwardResult extends ResultBase {
  kind: "forward_backward";
  packing: PackingOutcome;
  token_logprobs: TokenLogprobs[];
  group_shapes: unknown[];
  training: {
    accepted_trainable_tokens: number;
    policy_token_counts: { policy_version: number; accepted_trainable_tokens: number }[] | null;
  };
  loss: { contract_id: string; value: number; reduction: "mean_active_token" };
  produced_gradient: boolean;
}
export interface OptimStepResult extends ResultBase {
  kind: "optim_step";
  contributing_operation_ids: string[];
  checkpoint: CheckpointRef;
  learner_version: number;
}
export interface SaveWeightsForSamplerResult extends ResultBase {
  kind: "save_weights_for_sampler";
  target: "active" | "saved_generation";
  model_alias: string;
  generation_id: string;
  learner_version: number;
  checkpoint: CheckpointRef;
}
export interface SaveStateResult extends ResultBase {
  kind: "save_state";
  checkpoint: CheckpointRef;
  archive: {
    checkpoint_id: string;
    learner_version: number;
    components: ("weights" | "optimizer")[];
    wandb_artifact: string;
  } | null;
}
export interface LoadStateResult extends ResultBase {
  kind: "load_state";
  checkpoint: CheckpointRef;
  optimizer_restored: boolean;
}
export type OperationResult =
  | ForwardResult
  | ForwardBackwardResult
  | OptimStepResult
  | SaveWeightsForSamplerResult
  | SaveStateResult
  | LoadStateResult;
/** The result type of each kind. */
export interface ResultOf {
  forward: ForwardResult;
  forward_backward: ForwardBackwardResult;
  optim_step: OptimStepResult;
  save_weights_for_sampler: SaveWeightsForSamplerResult;
  save_state: SaveStateResult;
  load_state: LoadStateResult;
}

/** ART's `NativeTrainingResultRelease`. */
export interface ResultRelease {
  operation_id: string;
  request_id: string;
  released: true;
}
