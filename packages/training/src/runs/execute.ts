import type { Kernels } from "@arbor/engine/kernels";
import {
  adapterFromFiles,
  adapterToFiles,
  createLoraAdapter,
  HEAD_TARGET,
  LORA_TARGETS,
  type LoraAdapter,
  loraParameters,
  type Model,
  readSafetensors,
} from "@arbor/engine/model";
import { LoraTrainer } from "@arbor/engine/train";
import {
  type BlobStore,
  ConflictError,
  type Json,
  type OperationOutcome,
  type Store,
  type TrainingOperation,
  type TrainingRun,
  uuidv7,
} from "@arbor/store";
import {
  ADAPTER_FILES,
  activeJobOf,
  type CheckpointFiles,
  OPTIMIZER_FILE,
  readCheckpointFiles,
  writeCheckpointFiles,
  writeFilesAt,
} from "../checkpoints.ts";
import {
  advantageScale,
  decodeBatch,
  lossObjective,
  type Matrix,
  policyTokenCounts,
  type WireBatch,
  type WireLoss,
} from "./token-matrix.ts";

/**
 * Runs the operations of the native training API (ADR 57) on a training worker: the learner of
 * a run is its committed state (a PEFT adapter and AdamW's moments, under a blob prefix of the
 * run's) and its open gradient (a blob); each operation reads them, and its outcome names what
 * it wrote, which the store commits with the operation's end in one transaction. Nothing is
 * overwritten, so an operation cut off midway leaves the run as it was.
 */

/** The spec of a run as the wire carries it. */
export interface RunSpec {
  base_model: string;
  lora_rank: number;
  lora_target_modules: string[];
  seed: number | null;
}

/** What an executed operation reports for metrics. */
export interface RunActivity {
  kind: TrainingOperation["kind"];
  outcome: "succeeded" | "failed" | "cancelled";
  tokens: number;
  loss: number | null;
  learnerVersion: number;
  /** From the start of its execution to its outcome. */
  seconds: number;
}

/** The prefix the blobs of every run's learner live under. */
export const RUNS_PREFIX = "training-runs/";

/** The prefix every blob of a run's learner lives under. */
export function runFilesPrefix(runId: string): string {
  return `${RUNS_PREFIX}${runId}/`;
}

/**
 * Commits an operation's outcome (when `workerId` still runs it), then deletes the learner blobs
 * it superseded; a crash between the two leaves them to the sweep. Answers the operation as
 * committed.
 */
export async function commitOutcome(
  store: Store,
  workerId: string,
  run: TrainingRun,
  op: TrainingOperation,
  outcome: OperationOutcome,
  onDropError: (err: unknown) => void,
): Promise<TrainingOperation | undefined> {
  const finished = await store.trainingRuns.finishOperation(workerId, op, outcome);
  if (finished?.status === "succeeded" && outcome.status === "succeeded")
    await dropSuperseded(store, [
      outcome.learner ? run.state_key : null,
      outcome.grad_key !== undefined ? run.grad_key : null,
    ]).catch(onDropError);
  return finished;
}

/**
 * Deletes the learner blobs among `keys` (state prefixes, gradient keys) that nothing names any
 * more (no run's committed state or open gradient, no unexpired saved state): what an operation
 * superseded, once its outcome is committed. Answers the keys deleted.
 */
export async function dropSuperseded(
  store: Store,
  keys: readonly (string | null | undefined)[],
): Promise<string[]> {
  const candidates = [
    ...new Set(keys.filter((k): k is string => !!k && k.startsWith(RUNS_PREFIX))),
  ];
  if (candidates.length === 0) return [];
  const named = await store.trainingRuns.referencedLearnerKeys(candidates);
  const dropped = candidates.filter((key) => !named.has(key));
  for (const key of dropped)
    await (key.endsWith("/") ? store.blobs.deletePrefix(key) : store.blobs.delete(key));
  return dropped;
}

/** Writes a learner state (adapter, and the optimizer's when given) under a new prefix. */
export async function writeLearnerState(
  blobs: BlobStore,
  runId: string,
  version: number,
  files: CheckpointFiles,
): Promise<string> {
  return writeFilesAt(blobs, `${runFilesPrefix(runId)}v${version}-${uuidv7()}/`, files);
}

/**
 * A saved state's files for a new learner: its own prefix when the optimizer comes too, else its
 * adapter alone under a new prefix of the run's. Answers the prefix and whether it has moments.
 */
export async function learnerFromState(
  blobs: BlobStore,
  statePrefix: string,
  runId: string,
  version: number,
  restoreOptimizer: boolean,
): Promise<{ stateKey: string; optimizerRestored: boolean }> {
  const hasOptimizer = await blobs.exists(`${statePrefix}${OPTIMIZER_FILE}`);
  if (restoreOptimizer || !hasOptimizer)
    return { stateKey: statePrefix, optimizerRestored: restoreOptimizer && hasOptimizer };
  const adapter = await readCheckpointFiles(blobs, statePrefix, ADAPTER_FILES);
  return {
    stateKey: await writeLearnerState(blobs, runId, version, adapter),
    optimizerRestored: false,
  };
}

/** A fresh adapter of the spec: rank r, alpha 2r, its targets; seeded by the spec or the run. */
export function freshAdapter(base: Model, spec: RunSpec, runId: string): LoraAdapter {
  const seed = spec.seed ?? Number.parseInt(runId.replaceAll("-", "").slice(-12), 16);
  return createLoraAdapter(
    base,
    {
      baseModel: spec.base_model,
      rank: spec.lora_rank,
      alpha: 2 * spec.lora_rank,
      targetModules: LORA_TARGETS.filter((t) => spec.lora_target_modules.includes(t)),
      head: spec.lora_target_modules.includes(HEAD_TARGET),
    },
    seed,
  );
}

/**
 * Where a running operation may stop when a cancel was asked, nothing of it applied: `start`
 * (before any work), `micro_batch` (before each backward or forward pass of a forward or
 * forward_backward: one matrix, one target column) and `apply` (before the operation writes
 * what it made: a gradient, a step of the optimizer, a publication, a saved or loaded state).
 */
export type SafePoint = "start" | "micro_batch" | "apply";

export interface RunExecutorOptions {
  /**
   * Awaited at each safe point of each operation, before the executor reads whether a cancel
   * was asked: tests gate the executor here to cancel at a point of their choosing.
   */
  atSafePoint?: (op: TrainingOperation, point: SafePoint) => Promise<void>;
}

/** Thrown at a safe point of an operation whose cancel was asked. */
class Cancelled extends Error {}

/** Thrown for an operation that fails alone with an ART error code. */
class OperationError extends Error {
  readonly code: string;
  constructor(code: string, message: string) {
    super(message);
    this.code = code;
  }
}

/** Sets up the learner of a run and runs its operations. */
export class RunExecutor {
  readonly #store: Store;
  readonly #base: Model;
  readonly #kernels: Kernels;
  readonly #atSafePoint: RunExecutorOptions["atSafePoint"];

  constructor(store: Store, base: Model, kernels: Kernels, options: RunExecutorOptions = {}) {
    this.#store = store;
    this.#base = base;
    this.#kernels = kernels;
    this.#atSafePoint = options.atSafePoint;
  }

  /** A safe point: stops the operation (`Cancelled`) when a cancel of it was asked. */
  async #safePoint(op: TrainingOperation, point: SafePoint): Promise<void> {
    await this.#atSafePoint?.(op, point);
    if (await this.#store.trainingRuns.cancelRequested(op.id)) throw new Cancelled();
  }

  /**
   * Runs the run's admitted operations in sequence order under `workerId`'s lease, as a worker
   * does: each is started, executed on the run as it is then, and its outcome committed. Stops
   * when none is left, when one cannot start (the lease is lost), or once `stopping()`.
   */
  async runOperations(
    workerId: string,
    runId: string,
    hooks: {
      stopping?: () => boolean;
      onDropError: (err: unknown) => void;
      onExecuted?: (
        op: TrainingOperation,
        outcome: OperationOutcome,
        activity: RunActivity,
      ) => void;
    },
  ): Promise<void> {
    const runs = this.#store.trainingRuns;
    for (
      let op = await runs.nextOperation(runId);
      op && !hooks.stopping?.();
      op = await runs.nextOperation(runId)
    ) {
      const run = await runs.startOperation(workerId, op);
      if (!run) break;
      const { outcome, activity } = await this.execute(run, op);
      await commitOutcome(this.#store, workerId, run, op, outcome, hooks.onDropError);
      hooks.onExecuted?.(op, outcome, activity);
    }
  }

  /** Runs `op` on `run` (as it is now: every earlier operation ended) and answers its outcome. */
  async execute(
    run: TrainingRun,
    op: TrainingOperation,
  ): Promise<{ outcome: OperationOutcome; activity: RunActivity }> {
    const activity: RunActivity = {
      kind: op.kind,
      outcome: "succeeded",
      tokens: 0,
      loss: null,
      learnerVersion: op.reserved_version ?? run.committed_version,
      seconds: 0,
    };
    const started = performance.now();
    try {
      const outcome = await this.#run(run, op, activity);
      return { outcome, activity };
    } catch (err) {
      if (err instanceof Cancelled) {
        activity.outcome = "cancelled";
        activity.tokens = 0;
        activity.loss = null;
        return { outcome: { status: "cancelled" }, activity };
      }
      activity.outcome = "failed";
      const code = err instanceof OperationError ? err.code : "execution_failed";
      return { outcome: { status: "failed", code }, activity };
    } finally {
      activity.seconds = (performance.now() - started) / 1000;
    }
  }

  async #run(
    run: TrainingRun,
    op: TrainingOperation,
    activity: RunActivity,
  ): Promise<OperationOutcome> {
    const body = op.body as Record<string, Json>;
    const resolved = (op.resolved ?? {}) as Record<string, Json>;
    const version = run.committed_version;
    const checkpoint = (v: number) => ({ checkpoint_id: `${run.id}:v${v}`, learner_version: v });
    await this.#safePoint(op, "start");
    switch (op.kind) {
      case "forward":
      case "forward_backward":
        return this.#forward(run, op, body, activity);
      case "optim_step": {
        const optimizer = body.optimizer as Record<string, number>;
        const trainer = await this.#trainer(run, true, {
          adamW: {
            beta1: optimizer.beta1 ?? 0.9,
            beta2: optimizer.beta2 ?? 0.99,
            eps: optimizer.eps ?? 1e-13,
            weightDecay: optimizer.weight_decay ?? 0.1,
          },
          maxGradNorm: optimizer.grad_clip_norm ?? 0.1,
        });
        if (!run.grad_key) throw new Error("the run's open gradient is missing");
        await this.#loadGradient(trainer, run.grad_key);
        await this.#safePoint(op, "apply");
        trainer.step(optimizer.learning_rate!);
        const next = op.reserved_version!;
        const stateKey = await writeLearnerState(this.#store.blobs, run.id, next, {
          ...adapterToFiles(trainer.adapter),
          [OPTIMIZER_FILE]: trainer.optimizerStateToBytes(),
        });
        return {
          status: "succeeded",
          learner: { version: next, state_key: stateKey },
          grad_key: null,
          result: {
            operation_id: op.id,
            kind: "optim_step",
            metrics: {},
            contributing_operation_ids: op.contributes ?? [],
            checkpoint: checkpoint(next),
            learner_version: next,
          },
        };
      }
      case "save_weights_for_sampler": {
        const modelId = String(resolved.model_id);
        const entity = String(resolved.entity);
        const active = await activeJobOf(this.#store, entity, modelId);
        if (active)
          throw new OperationError(
            "operation_conflict",
            `model ${modelId} has a training job ${active.status}`,
          );
        // The committed adapter's files as stored (a fresh adapter's when none is committed).
        const files = run.state_key
          ? await readCheckpointFiles(this.#store.blobs, run.state_key, ADAPTER_FILES)
          : adapterToFiles(freshAdapter(this.#base, run.spec as unknown as RunSpec, run.id));
        await this.#safePoint(op, "apply");
        const prefix = await writeCheckpointFiles(this.#store.blobs, modelId, version, files);
        const published = await this.#store.models.putCheckpoint(entity, modelId, {
          step: version,
          blob_key: prefix,
        });
        const publication = body.publication as Record<string, string>;
        return {
          status: "succeeded",
          result: {
            operation_id: op.id,
            kind: "save_weights_for_sampler",
            metrics: {},
            target: publication.target!,
            model_alias: String(resolved.model_alias),
            generation_id: published.id,
            learner_version: version,
            checkpoint: checkpoint(version),
          },
        };
      }
      case "save_state": {
        await this.#safePoint(op, "apply");
        const stateKey = await this.#committedState(run);
        const hasOptimizer = await this.#store.blobs.exists(`${stateKey}${OPTIMIZER_FILE}`);
        const components = hasOptimizer ? ["weights", "optimizer"] : ["weights"];
        let saved: Awaited<ReturnType<Store["trainingRuns"]["saveState"]>>;
        try {
          saved = await this.#store.trainingRuns.saveState({
            entity: run.entity,
            run_id: run.id,
            name: String(body.checkpoint_name),
            spec: run.spec,
            learner_version: version,
            state_key: stateKey,
            ttl_ms: typeof body.ttl_seconds === "number" ? body.ttl_seconds * 1000 : null,
            overwrite: body.overwrite === true,
          });
        } catch (err) {
          if (err instanceof ConflictError)
            throw new OperationError("operation_conflict", err.message);
          throw err;
        }
        const ref = { checkpoint_id: saved.id, learner_version: version };
        return {
          status: "succeeded",
          result: {
            operation_id: op.id,
            kind: "save_state",
            metrics: {},
            checkpoint: ref,
            archive: {
              ...ref,
              components,
              wandb_artifact: `${run.entity}/${String(resolved.project)}/${saved.id}:v${version}`,
            },
          },
        };
      }
      case "load_state": {
        const next = op.reserved_version!;
        await this.#safePoint(op, "apply");
        const { stateKey, optimizerRestored } = await learnerFromState(
          this.#store.blobs,
          String(resolved.state_key),
          run.id,
          next,
          body.restore_optimizer === true,
        );
        return {
          status: "succeeded",
          learner: { version: next, state_key: stateKey },
          result: {
            operation_id: op.id,
            kind: "load_state",
            metrics: {},
            checkpoint: checkpoint(next),
            optimizer_restored: optimizerRestored,
          },
        };
      }
    }
  }

  async #forward(
    run: TrainingRun,
    op: TrainingOperation,
    body: Record<string, Json>,
    activity: RunActivity,
  ): Promise<OperationOutcome> {
    const backward = op.kind === "forward_backward";
    const loss = body.loss as unknown as WireLoss;
    const matrices = decodeBatch(body.batch as unknown as WireBatch, loss, this.#base.config);
    const trainer = await this.#trainer(run, false);
    if (backward && run.grad_key) await this.#loadGradient(trainer, run.grad_key);
    const keepLogprobs = body.return_token_logprobs === true;
    const scale = advantageScale(matrices, loss);
    let sum = 0;
    let active = 0;
    const tokenLogprobs: { matrix_id: string; shape: number[]; data: string }[] = [];
    for (const m of matrices) {
      const logprobs = new Float32Array(m.T * m.K);
      for (let k = 0; k < m.K; k++) {
        const batch = trainBatch(m, k, keepLogprobs);
        const options = {
          objective: lossObjective(m, loss, k, scale),
          maskedRowsOnly: !keepLogprobs,
        };
        await this.#safePoint(op, "micro_batch");
        const out = backward ? trainer.backward(batch, options) : trainer.evaluate(batch, options);
        sum += out.loss;
        for (let p = 0; p < m.T; p++) logprobs[p * m.K + k] = out.tokenLogprobs[p]!;
      }
      active += m.activeCount;
      if (keepLogprobs)
        tokenLogprobs.push({
          matrix_id: m.id,
          shape: [m.T, m.K],
          data: Buffer.from(logprobs.buffer).toString("base64"),
        });
    }
    const value = loss.reduction === "sum" ? sum : sum / active;
    if (!Number.isFinite(value)) throw new Error("the loss is not finite");
    activity.tokens = active;
    activity.loss = value;
    const logical = matrices.reduce((n, m) => n + m.T, 0);
    const longest = Math.max(...matrices.map((m) => m.T));
    const packing = {
      packed_sequence_length: longest,
      packed_sequences: matrices.length,
      target_packed_sequences: matrices.length,
      logical_tokens: logical,
      physical_tokens: logical,
      packed_capacity_tokens: longest * matrices.length,
      padding_tokens: longest * matrices.length - logical,
    };
    const common = {
      operation_id: op.id,
      kind: op.kind,
      metrics: {},
      packing,
      token_logprobs: tokenLogprobs,
      group_shapes: [],
    };
    const progress = { loss: value, tokens: active };
    if (!backward) return { status: "succeeded", result: common, progress };
    for (const p of loraParameters(trainer.grads))
      for (const g of p.data)
        if (!Number.isFinite(g)) throw new Error("the gradient is not finite");
    await this.#safePoint(op, "apply");
    const gradKey = `${runFilesPrefix(run.id)}grad-${op.sequence_id}-${uuidv7()}.safetensors`;
    await this.#store.blobs.put(
      gradKey,
      adapterToFiles(trainer.grads)["adapter_model.safetensors"]!,
    );
    return {
      status: "succeeded",
      grad_key: gradKey,
      progress,
      result: {
        ...common,
        training: {
          accepted_trainable_tokens: active,
          policy_token_counts: policyTokenCounts(matrices),
        },
        loss: { contract_id: `${loss.name}_v1`, value, reduction: "mean_active_token" },
        produced_gradient: true,
      },
    };
  }

  /** The blob prefix of the run's committed learner, written first for a fresh one. */
  async #committedState(run: TrainingRun): Promise<string> {
    if (run.state_key) return run.state_key;
    const adapter = freshAdapter(this.#base, run.spec as unknown as RunSpec, run.id);
    return writeLearnerState(
      this.#store.blobs,
      run.id,
      run.committed_version,
      adapterToFiles(adapter),
    );
  }

  /**
   * A trainer over the run's committed learner; its optimizer's moments restored when `optimizer`
   * (only a step uses them: the others read the adapter alone).
   */
  async #trainer(
    run: TrainingRun,
    optimizer: boolean,
    options: ConstructorParameters<typeof LoraTrainer>[2] = {},
  ): Promise<LoraTrainer> {
    const names = optimizer ? [...ADAPTER_FILES, OPTIMIZER_FILE] : ADAPTER_FILES;
    const files = run.state_key
      ? await readCheckpointFiles(this.#store.blobs, run.state_key, names)
      : undefined;
    const adapter = files
      ? adapterFromFiles(files, this.#base)
      : freshAdapter(this.#base, run.spec as unknown as RunSpec, run.id);
    const trainer = new LoraTrainer(this.#base, adapter, { ...options, kernels: this.#kernels });
    const moments = files?.[OPTIMIZER_FILE];
    if (moments) trainer.loadOptimizerState(moments);
    return trainer;
  }

  /** Adds the run's open gradient (the blob at `key`) into the trainer's. */
  async #loadGradient(trainer: LoraTrainer, key: string): Promise<void> {
    const bytes = await this.#store.blobs.get(key);
    if (!bytes) throw new Error("the run's open gradient is missing");
    const { tensors } = readSafetensors(bytes);
    for (const p of loraParameters(trainer.grads)) {
      const t = tensors.get(p.name);
      if (!t || t.data.length !== p.data.length) throw new Error(`gradient ${p.name} is missing`);
      p.data.set(t.data);
    }
  }
}

/** One target column of a matrix as the engine's batch: one sequence, the column's targets. */
function trainBatch(m: Matrix, column: number, everyRow: boolean) {
  const targets = new Int32Array(m.T);
  const lossMask = new Float32Array(m.T);
  for (let p = 0; p < m.T; p++) {
    targets[p] = m.targets[p * m.K + column]!;
    lossMask[p] = everyRow || m.active[p] ? 1 : 0;
  }
  return { batchSize: 1, seqLen: m.T, inputs: m.tokens, targets, lossMask };
}
