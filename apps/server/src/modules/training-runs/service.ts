import { createHash } from "node:crypto";
import type { components } from "@arbor/spec/schema";
import {
  ConflictError,
  canonical,
  DomainError,
  InvalidInputError,
  NotFoundError,
  quote,
  type Store,
  type TrainingOperation,
  type TrainingRun,
  type TrainingState,
} from "@arbor/store";
import { findOwned, type Principal } from "../access.ts";

type Schemas = components["schemas"];

/** The sha-256 of a body's canonical JSON: what makes a replay exact (ADR 57). */
export function fingerprint(body: unknown): string {
  return createHash("sha256").update(canonical(body)).digest("base64url");
}

const iso = (ms: number | null) => (ms === null ? null : new Date(ms).toISOString());

export function runToWire(run: TrainingRun): Schemas["TrainingRun"] {
  return {
    run_id: run.id,
    run_name: run.run_name,
    spec: run.spec as Schemas["TrainingRun"]["spec"],
    status: run.status,
    next_sequence_id: run.next_sequence_id,
    projected_learner_version: run.projected_version,
    committed_learner_version: run.committed_version,
  };
}

/** A result kept, or null once released or past its 24 hours. */
export function keptResult(op: TrainingOperation): string | null {
  if (op.result === null || op.result_expires_at === null || op.result_expires_at <= Date.now())
    return null;
  return op.result;
}

export function operationToWire(op: TrainingOperation): Schemas["TrainingOperation"] {
  const result = keptResult(op);
  return {
    operation_id: op.id,
    run_id: op.run_id,
    request_id: op.request_id,
    sequence_id: op.sequence_id,
    kind: op.kind,
    status: op.status,
    learner_parent_version: op.parent_version,
    reserved_output_learner_version: op.reserved_version,
    admitted_at: iso(op.admitted_at)!,
    started_at: iso(op.started_at),
    ended_at: iso(op.ended_at),
    cancel_requested: op.cancel_requested,
    latest_event_cursor: op.event_cursor,
    result_summary: null,
    result_ref:
      result === null
        ? null
        : {
            result_id: op.result_id!,
            media_type: "application/json",
            size_bytes: Buffer.byteLength(result),
            expires_at: iso(op.result_expires_at)!,
          },
    error: op.error_code === null ? null : { code: op.error_code },
  } as Schemas["TrainingOperation"];
}

/** An operation with what it measured (`listTrainingOperations`). */
export function operationProgress(op: TrainingOperation): Schemas["TrainingOperationProgress"] {
  return {
    operation: operationToWire(op),
    loss: op.loss,
    tokens: op.tokens,
    learner_version: op.reserved_version ?? op.parent_version,
  };
}

/** A run of an entity the principal may use; any other is 404. */
export async function findRun(
  store: Store,
  principal: Principal,
  runId: string,
): Promise<TrainingRun> {
  const run = await findOwned(principal, (entity) => store.trainingRuns.get(entity, runId));
  if (run) return run;
  throw new NotFoundError(`Training run ${quote(runId)} not found.`, {
    code: "training_run_not_found",
  });
}

export async function findOperation(
  store: Store,
  run: TrainingRun,
  operationId: string,
): Promise<TrainingOperation> {
  const op = await store.trainingRuns.getOperation(run.id, operationId);
  if (op) return op;
  throw operationNotFound(run, operationId);
}

/** 404 `operation_not_found`: the run has no operation `operationId`. */
export function operationNotFound(run: TrainingRun, operationId: string): NotFoundError {
  return new NotFoundError(`Operation ${quote(operationId)} of run ${run.id} not found.`, {
    code: "operation_not_found",
  });
}

type Source = Schemas["CheckpointSource"];
type Spec = Schemas["TrainingRunSpec"];

/** A `wandb_artifact` source: Arbor keeps no W&B artifacts (400). */
export function serviceCheckpointId(source: Source, param: string): string {
  if (source.kind !== "service_checkpoint")
    throw new InvalidInputError(
      "Arbor keeps no W&B artifacts: name a state saved in Arbor (service_checkpoint)",
      { code: "unsupported_checkpoint_source", param },
    );
  return source.checkpoint_id;
}

/** A saved state of the entity that a run of `spec` can load: 404, or 409 when its base, rank or
 * targets differ. */
export async function loadableState(
  store: Store,
  entity: string,
  stateId: string,
  spec: Spec,
): Promise<TrainingState> {
  const state = await store.trainingRuns.getState(entity, stateId);
  if (!state)
    throw new NotFoundError(`Saved state ${quote(stateId)} not found.`, {
      code: "checkpoint_not_found",
    });
  const saved = state.spec as unknown as Spec;
  const same =
    saved.base_model === spec.base_model &&
    saved.lora_rank === spec.lora_rank &&
    [...saved.lora_target_modules].sort().join() === [...spec.lora_target_modules].sort().join();
  if (!same)
    throw new ConflictError(
      `Saved state ${stateId} is of another base model, rank or target modules than the run`,
      { code: "checkpoint_incompatible", shouldRetry: false },
    );
  return state;
}

/**
 * The model a `model_alias` names in the entity: `<entity>/<project>/<name>`, or a bare name
 * that must name one model (404 `model_not_found`, 409 `ambiguous_model_alias`); its base must be
 * the run's, and so must the rank and target modules of every checkpoint it has (409
 * `adapter_mismatch`).
 */
export async function modelOfAlias(
  store: Store,
  entity: string,
  alias: string,
  spec: Pick<Spec, "base_model" | "lora_rank" | "lora_target_modules">,
): Promise<{ model_id: string; model_alias: string }> {
  const baseModel = spec.base_model;
  const parts = alias.split("/");
  let models: Awaited<ReturnType<Store["models"]["findByName"]>>;
  if (parts.length === 3 && parts[0] === entity) {
    const model = await store.models.getByName(entity, parts[1]!, parts[2]!);
    models = model ? [model] : [];
  } else if (parts.length === 1) {
    models = await store.models.findByName(entity, alias);
  } else models = [];
  const id = (m: (typeof models)[number]) => `${m.entity}/${m.project}/${m.name}`;
  if (models.length === 0)
    throw new NotFoundError(`No model ${quote(alias)} in entity ${entity}.`, {
      code: "model_not_found",
    });
  if (models.length > 1)
    throw new ConflictError(
      `model_alias ${quote(alias)} names several models: ${models.map(id).join(", ")}; send the full id`,
      { code: "ambiguous_model_alias", shouldRetry: false },
    );
  const model = models[0]!;
  if (model.base_model !== baseModel)
    throw new ConflictError(
      `Model ${id(model)} is of base model ${model.base_model}, the run of ${baseModel}`,
      { code: "adapter_mismatch", shouldRetry: false },
    );
  const differs = await adapterDifference(store, model, spec);
  if (differs)
    throw new ConflictError(`Model ${id(model)} ${differs}`, {
      code: "adapter_mismatch",
      shouldRetry: false,
    });
  return { model_id: model.id, model_alias: id(model) };
}

const targetsOf = (targets: unknown) =>
  Array.isArray(targets) ? [...targets].map(String).sort().join(", ") : String(targets);

/**
 * How the first of a model's checkpoints with files whose `adapter_config.json` differs from the
 * run's in rank or target modules differs ("has checkpoint step 3 of LoRA rank 16, the run 8"); null
 * when none does (a model without checkpoints accepts any run).
 */
async function adapterDifference(
  store: Store,
  model: { entity: string; id: string },
  spec: Pick<Spec, "lora_rank" | "lora_target_modules">,
): Promise<string | null> {
  const targets = targetsOf(spec.lora_target_modules);
  let after: string | undefined;
  for (;;) {
    const page = await store.models.listCheckpoints(model.entity, model.id, { after, limit: 1000 });
    for (const checkpoint of page.data) {
      if (!checkpoint.blob_key) continue;
      const bytes = await store.blobs.get(`${checkpoint.blob_key}adapter_config.json`);
      if (!bytes) continue;
      let config: { r?: unknown; target_modules?: unknown };
      try {
        config = JSON.parse(bytes.toString("utf8"));
      } catch {
        continue;
      }
      const at = `has checkpoint step ${checkpoint.step}`;
      if (config.r !== spec.lora_rank)
        return `${at} of LoRA rank ${String(config.r)}, the run ${spec.lora_rank}`;
      const theirs = targetsOf(config.target_modules);
      if (theirs !== targets) return `${at} of target modules [${theirs}], the run [${targets}]`;
    }
    if (!page.has_more || !page.last_id) return null;
    after = page.last_id;
  }
}

/** Runs `fn`; a refusal it throws is kept, to be raised where the ledger's order puts it. */
export async function attempt<T>(
  fn: () => Promise<T>,
): Promise<{ value: T | undefined; refusal: DomainError | null }> {
  try {
    return { value: await fn(), refusal: null };
  } catch (err) {
    if (err instanceof DomainError) return { value: undefined, refusal: err };
    throw err;
  }
}
