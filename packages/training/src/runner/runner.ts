import { randomUUID } from "node:crypto";
import { hostname } from "node:os";
import { createWasmKernels, type Kernels, type WasmKernels } from "@arbor/engine/kernels";
import {
  adapterFromFiles,
  adapterToFiles,
  adapterWeightProblem,
  createLoraAdapter,
  EngineMemoryError,
  type LoraAdapter,
  type LoraConfig,
  type Model,
  parameterCount,
} from "@arbor/engine/model";
import {
  type DpoConfig,
  type DpoPair,
  dpoMicroBatchBudget,
  evaluateSft,
  LoraTrainer,
  microBatchBudget,
  planDpo,
  planSft,
  type SftConfig,
  type SftEvalMetrics,
  type SftExample,
  type SftSequence,
  sftSequences,
  TrainingInputError,
  type TrajectoryGroup,
  trainDpo,
  trainRlStep,
  trainSft,
} from "@arbor/engine/train";
import type { JobType, Store, TrainingJob } from "@arbor/store";
import type { Logger } from "pino";
import { OPTIMIZER_FILE, readCheckpointFiles, writeCheckpointFiles } from "../checkpoints.ts";
import { JobInputError } from "../errors.ts";
import {
  defaultLora,
  dpoTrainingConfig,
  MAX_JOB_EXAMPLES,
  MAX_JOB_STEPS,
  MAX_JOB_TOKENS,
  MAX_VALIDATION_EXAMPLES,
  MAX_VALIDATION_TOKENS,
  rlJobSpec,
  rlStepConfig,
  type SftJobSpec,
  sftJobSpec,
  sftTrainingConfig,
  validationSteps,
} from "../jobs.ts";
import { type RunActivity, RunExecutor, type RunSpec } from "../runs/execute.ts";
import { sweepBlobs } from "../sweep.ts";
import { clearCancelled, idWords, isCancelled, isStopping } from "./cancel.ts";

export interface TrainingWorkerOptions {
  store: Store;
  logger: Logger;
  /** The base model `baseId`, its weights kept in `kernels` (the kernels jobs train on). */
  loadBaseModel: (baseId: string, kernels: Kernels) => Promise<Model>;
  /** The SFT examples behind a `training_data_url` (`dataset://` or `https://`), validated;
   * throws TrainingInputError naming the bad line. */
  loadSftExamples: (entity: string, url: string) => Promise<SftExample[]>;
  /** The preference pairs behind the `training_data_url` of an SFT job whose `config.method`
   * is `dpo` (ADR 69), validated; throws naming the bad line. Without it such jobs fail. */
  loadDpoPairs?: (entity: string, url: string) => Promise<DpoPair[]>;
  /**
   * Who this worker is. With a `persistent` identity (stable across restarts), a restarted
   * worker reclaims the jobs its previous run held at once; without, they wait for their lease.
   */
  identity?: { stable: string; persistent: boolean };
  /** How long a claim lasts without renewal; a dead worker's job is reclaimed after it. */
  leaseMs?: number;
  /** How often a running job's lease is renewed (and a cancel noticed). Default 1 s. */
  heartbeatMs?: number;
  /** Pause between queue polls when idle. */
  pollMs?: number;
  /** Told when a job starts (its id) and ends (null): a supervisor knows what a death takes. */
  onJob?: (jobId: string | null, jobType?: TrainingJob["type"]) => void;
  /** Kernel threads the training computation shares (this thread included). Default 1. */
  kernelThreads?: number;
  /**
   * Makes the kernels jobs train on: on a wasm32 arena, or on a Memory64 one for the jobs that
   * need more than 4 GiB. Default `createWasmKernels("auto", { threads: kernelThreads, memory64 })`.
   */
  createKernels?: (memory64: boolean) => WasmKernels;
  /** Told of the work done, for metrics: tokens trained per step, and how each run ended. */
  onActivity?: (activity: TrainingActivity) => void;
  /**
   * Shared memory where a supervisor on another thread writes the id of a job cancelled in
   * this process (`writeCancelled`), and that its worker is stopping (`writeStopping`): checked
   * between micro-batches, so a cancel stops the job, and a shutdown hands it back to the queue,
   * within the step it arrives in, while the lease check waits for the step to end.
   */
  cancelled?: Int32Array;
}

/** How a run of a job ended here. A run handed back to the queue (shutdown) is none of these. */
export type JobOutcome = "succeeded" | "failed" | "cancelled";

/** What a worker reports of its work; the process that runs the worker counts it (nothing here
 * knows how it is exported). */
export type TrainingActivity =
  /** A step trained on `tokens` tokens (its `num_tokens`). */
  | { type: "tokens"; jobType: JobType; tokens: number }
  /** A run of a job ended with `outcome`, `seconds` after this worker claimed it. */
  | { type: "ended"; jobType: JobType; outcome: JobOutcome; seconds: number }
  /** An operation of a native training run ended (ADR 57). */
  | ({ type: "operation" } & RunActivity);

/** Why a running job stopped without failing: cancelled or deleted elsewhere, or shutdown. */
class Interrupted extends Error {
  override name = "Interrupted";
  readonly release: boolean;
  constructor(message: string, release: boolean) {
    super(message);
    this.release = release;
  }
}

/** The metrics of the step a checkpoint was saved at, as the checkpoint keeps them:
 * `train/loss`, `train/grad_norm`, `train/learning_rate`, `train/reward` (RL), `train/num_tokens`,
 * `train/mean_token_accuracy` (SFT), `train/reward_margin` and `train/reward_accuracy` (DPO). */
function trainMetrics(step: Record<string, unknown>): Record<string, number> {
  const kept: Record<string, number> = {};
  const keys = [
    "loss",
    "grad_norm",
    "learning_rate",
    "reward",
    "num_tokens",
    "mean_token_accuracy",
    "reward_margin",
    "reward_accuracy",
  ];
  for (const key of keys) {
    const value = step[key];
    if (typeof value === "number" && Number.isFinite(value)) kept[`train/${key}`] = value;
  }
  return kept;
}

/** The validation set's metrics at a checkpoint's step, as the checkpoint keeps them:
 * `validation/loss` and `validation/mean_token_accuracy` (the `<split>/<metric>` names that
 * `logModelMetrics` writes too). */
function validationMetrics(validation: SftEvalMetrics | undefined): Record<string, number> {
  const kept: Record<string, number> = {};
  if (!validation) return kept;
  for (const key of ["loss", "mean_token_accuracy"] as const) {
    const value = validation[key];
    if (Number.isFinite(value)) kept[`validation/${key}`] = value;
  }
  return kept;
}

/** A bad validation set's error: the file named, then what is wrong (a line's number). */
function validationError(url: string, err: unknown): string {
  return `Validation data (${url}): ${err instanceof Error ? err.message : String(err)}`;
}

/**
 * Takes queued jobs one at a time (one running job per model is the store's rule), trains, and
 * writes checkpoints and events. Checkpoint files go first, then the row, then the event; the
 * terminal event is written by the store with the terminal status. A job whose lease expires
 * (this worker died) is requeued and resumed from its last checkpoint.
 */
export class TrainingWorker {
  readonly #o: Required<
    Omit<
      TrainingWorkerOptions,
      | "identity"
      | "onJob"
      | "kernelThreads"
      | "createKernels"
      | "onActivity"
      | "cancelled"
      | "loadDpoPairs"
    >
  > &
    Pick<TrainingWorkerOptions, "onJob" | "onActivity" | "cancelled" | "loadDpoPairs">;
  readonly #createKernels: (memory64: boolean) => WasmKernels;
  #kernels: WasmKernels | undefined;
  /** Base models whose jobs needed a Memory64 arena: their next jobs start on one. */
  readonly #wide = new Set<string>();
  readonly #identity: { stable: string; persistent: boolean };
  readonly #workerId: string;
  #stopping = false;
  #loop: Promise<void> | undefined;
  #current: AbortController | undefined;
  #wake: (() => void) | undefined;
  #lastReclaim = 0;

  constructor(options: TrainingWorkerOptions) {
    const { identity, kernelThreads, createKernels, ...rest } = options;
    this.#createKernels =
      createKernels ??
      ((memory64) => createWasmKernels("auto", { threads: kernelThreads ?? 1, memory64 }));
    const leaseMs = options.leaseMs ?? 15_000;
    this.#o = {
      pollMs: 500,
      ...rest,
      leaseMs,
      heartbeatMs: Math.min(options.heartbeatMs ?? 1000, leaseMs / 3),
    };
    this.#identity = identity ?? {
      stable: `${hostname()}:${process.pid}:${randomUUID().slice(0, 8)}`,
      persistent: false,
    };
    // `#` and a boot id: the stable part names the worker, the rest this run of it.
    this.#workerId = `${this.#identity.stable}#${randomUUID().slice(0, 8)}`;
  }

  get workerId(): string {
    return this.#workerId;
  }

  start(): void {
    this.#loop ??= this.#run();
  }

  /** Wakes an idle worker now (a job was just queued in this process). */
  poke(): void {
    this.#wake?.();
  }

  /** Stops after handing a running job back to the queue. */
  async stop(): Promise<void> {
    this.#stopping = true;
    this.#current?.abort(new Interrupted("worker shutting down", true));
    this.#wake?.();
    await this.#loop;
  }

  async #run(): Promise<void> {
    const { store, logger } = this.#o;
    if (this.#identity.persistent) {
      const own = await store.jobs
        .reclaimOwnLeases(`${this.#identity.stable}#`, this.#workerId)
        .catch((err: unknown) => {
          logger.error({ err }, "could not reclaim the jobs of this worker's previous run");
          return { requeued: [], failed: [] };
        });
      for (const job of own.requeued)
        logger.warn({ jobId: job.id }, "this worker restarted mid-job: requeued, to resume");
      for (const job of own.failed)
        logger.warn({ jobId: job.id }, "this worker restarted mid-job once too often: job failed");
    }
    // The stopping word may come before the message that stops this loop: no new claim then.
    while (!this.#stopping && !isStopping(this.#o.cancelled)) {
      try {
        await this.#reclaim();
        const job = await store.jobs.claimNextJob(this.#workerId, this.#o.leaseMs);
        if (job) await this.runJob(job);
        else if (!(await this.#runNativeRun())) await this.#idle();
      } catch (err) {
        logger.error({ err }, "training worker loop failed");
        await this.#idle();
      }
    }
  }

  /**
   * Leases a native training run with operations to execute (ADR 57) and runs them in sequence
   * order while it has some; false when no run had any.
   */
  async #runNativeRun(): Promise<boolean> {
    const { store, logger, leaseMs } = this.#o;
    const runs = store.trainingRuns;
    const claimed = await runs.claimRun(this.#workerId, leaseMs);
    if (!claimed) return false;
    const renew = setInterval(() => {
      runs
        .renewLease(this.#workerId, claimed.id, leaseMs)
        .catch((err: unknown) => logger.warn({ err, runId: claimed.id }, "lease renewal failed"));
    }, this.#o.heartbeatMs);
    try {
      const spec = claimed.spec as unknown as RunSpec;
      await this.#onArena(spec.base_model, async (kernels) => {
        const executor = new RunExecutor(
          store,
          await this.#o.loadBaseModel(spec.base_model, kernels),
          kernels,
        );
        await executor.runOperations(this.#workerId, claimed.id, {
          stopping: () => this.#stopping,
          onDropError: (err) =>
            logger.warn({ err, runId: claimed.id }, "could not delete superseded learner blobs"),
          onExecuted: (op, outcome, activity) => {
            this.#o.onActivity?.({ type: "operation", ...activity });
            if (outcome.status === "failed")
              logger.info(
                { runId: claimed.id, operationId: op.id, code: outcome.code },
                "training operation failed",
              );
            else if (outcome.status === "cancelled")
              logger.info(
                { runId: claimed.id, operationId: op.id },
                "training operation cancelled",
              );
          },
        });
      });
    } finally {
      clearInterval(renew);
      await runs.releaseLease(this.#workerId, claimed.id).catch(() => undefined);
    }
    return true;
  }

  async #reclaim(): Promise<void> {
    const now = Date.now();
    if (now - this.#lastReclaim < this.#o.leaseMs / 4) return;
    this.#lastReclaim = now;
    const { requeued, failed } = await this.#o.store.jobs.reclaimExpiredLeases();
    for (const job of requeued)
      this.#o.logger.warn(
        { jobId: job.id },
        "lease expired: job requeued, to resume from its last checkpoint",
      );
    for (const job of failed)
      this.#o.logger.warn({ jobId: job.id }, "lease expired too often: job failed");
  }

  #idle(): Promise<void> {
    return new Promise((resolve) => {
      const timer = setTimeout(done, this.#o.pollMs);
      function done() {
        clearTimeout(timer);
        resolve();
      }
      this.#wake = done;
    });
  }

  /** Runs one claimed job to its end: succeeded, failed, cancelled elsewhere, or released. */
  async runJob(job: TrainingJob): Promise<void> {
    const { store, logger, leaseMs } = this.#o;
    const workerId = this.#workerId;
    const abort = new AbortController();
    const started = performance.now();
    const ended = (outcome: JobOutcome) =>
      this.#o.onActivity?.({
        type: "ended",
        jobType: job.type,
        outcome,
        seconds: (performance.now() - started) / 1000,
      });
    this.#current = abort;
    this.#o.onJob?.(job.id, job.type);
    const words = idWords(job.id);
    // The claim is fresh: a cancel of an earlier run of this job (its lease lapsed, it was
    // requeued and claimed here again) is not this run's; the row says if this run is cancelled.
    clearCancelled(this.#o.cancelled, words);
    const interrupt = () => {
      if (!abort.signal.aborted && isCancelled(this.#o.cancelled, words))
        abort.abort(new Interrupted("the job was cancelled", false));
      // A shutdown, told between micro-batches: the job goes back to the queue, not counted.
      if (!abort.signal.aborted && isStopping(this.#o.cancelled))
        abort.abort(new Interrupted("worker shutting down", true));
      abort.signal.throwIfAborted();
    };
    // After each step, before its event: the row says whether the job is still this worker's.
    // The shared word only carries the latest cancel of this process, and a separate worker
    // process has none; this catches every other cancel (and a deleted model) within a step.
    const held = async () => {
      interrupt();
      if (!(await store.jobs.renewLease(workerId, job.id, leaseMs)))
        abort.abort(new Interrupted("the job was cancelled or deleted", false));
      abort.signal.throwIfAborted();
    };
    const renew = setInterval(() => {
      store.jobs
        .renewLease(workerId, job.id, leaseMs)
        .then((held) => {
          if (!held) abort.abort(new Interrupted("the job was cancelled or deleted", false));
        })
        .catch((err: unknown) => logger.warn({ err, jobId: job.id }, "lease renewal failed"));
    }, this.#o.heartbeatMs);
    const log = logger.child({ jobId: job.id, type: job.type, attempt: job.attempts });
    try {
      log.info("training job started");
      const stepTo =
        job.type === "sft"
          ? await this.#runSft(job, abort.signal, interrupt, held)
          : await this.#runRl(job, abort.signal);
      abort.signal.throwIfAborted();
      await store.jobs.completeJob(workerId, job.id, { step_to: stepTo });
      ended("succeeded");
      log.info({ stepTo }, "training job succeeded");
    } catch (err) {
      const reason = abort.signal.aborted ? abort.signal.reason : err;
      if (reason instanceof Interrupted) {
        if (reason.release) await store.jobs.releaseJob(workerId, job.id).catch(() => false);
        else ended("cancelled");
        log.info({ reason: reason.message }, "training job interrupted");
      } else {
        // The job's own input, or work too large for the engine: its message is the error.
        const known =
          err instanceof TrainingInputError ||
          err instanceof EngineMemoryError ||
          err instanceof JobInputError;
        const message = known
          ? err.message
          : `training failed: ${err instanceof Error ? err.message : String(err)}`;
        if (!known) log.error({ err }, "training job failed");
        await store.jobs.failJob(workerId, job.id, message).then(
          () => ended("failed"),
          (e: unknown) => log.warn({ err: e }, "could not fail the job"),
        );
      }
    } finally {
      clearInterval(renew);
      this.#current = undefined;
      this.#o.onJob?.(null);
    }
    // The job no longer runs, so no one writes its model's files: remove folders it left
    // without a row (a cut-off save, a checkpoint written as the job was cancelled).
    await sweepBlobs(store, { modelId: job.model_id }).catch((err: unknown) =>
      logger.warn({ err, jobId: job.id }, "could not sweep the model's unnamed checkpoint files"),
    );
  }

  /** The adapter the job starts from (the model's checkpoint at `step`), or a fresh one. */
  async #startAdapter(
    job: TrainingJob,
    base: Model,
    step: number,
    lora: LoraConfig,
    seed: number,
  ): Promise<LoraAdapter> {
    const checkpoint = await this.#o.store.models.getCheckpoint(job.entity, job.model_id, step);
    if (!checkpoint) throw new JobInputError(`checkpoint step ${step} of the model is gone`);
    if (!checkpoint.blob_key) return createLoraAdapter(base, lora, seed);
    return adapterFromFiles(
      await readCheckpointFiles(this.#o.store.blobs, checkpoint.blob_key),
      base,
    );
  }

  /** Where the job starts: fixed on its first run, so a resumed job keeps its range. */
  async #stepFrom(job: TrainingJob): Promise<{ stepFrom: number; baseId: string }> {
    const model = await this.#o.store.models.get(job.entity, job.model_id);
    if (!model) throw new JobInputError("the model was deleted");
    if (job.attempts > 1 && job.step_from !== null)
      return { stepFrom: job.step_from, baseId: model.base_model };
    const stepFrom = model.latest_step ?? 0;
    await this.#o.store.jobs.updateProgress(this.#workerId, job.id, { step_from: stepFrom });
    return { stepFrom, baseId: model.base_model };
  }

  async #runSft(
    job: TrainingJob,
    signal: AbortSignal,
    interrupt: () => void,
    held: () => Promise<void>,
  ): Promise<number> {
    const { store } = this.#o;
    const spec = sftJobSpec(job);
    if (spec.config.method === "dpo") return this.#runDpo(job, signal, interrupt, held);
    const { stepFrom, baseId } = await this.#stepFrom(job);
    const examples = await this.#o
      .loadSftExamples(job.entity, job.payload_ref ?? "")
      .catch((err: unknown) => {
        // Bad data is the job's input, not a crash: its message (naming the line) is the error.
        throw new JobInputError(err instanceof Error ? err.message : String(err));
      });
    const validationUrl = spec.validation_data_url;
    const validationExamples =
      validationUrl === undefined
        ? undefined
        : await this.#o.loadSftExamples(job.entity, validationUrl).catch((err: unknown) => {
            throw new JobInputError(validationError(validationUrl, err));
          });
    // Planned once (every example tokenized), on the first arena tried; only the memory check
    // depends on the arena.
    let planned:
      | {
          sftConfig: SftConfig;
          plan: ReturnType<typeof planSft>;
          validation: SftSequence[] | undefined;
        }
      | undefined;
    const { base, kernels } = await this.#onArena(baseId, async (kernels) => {
      const base = await this.#o.loadBaseModel(baseId, kernels);
      planned ??= this.#planSft(
        base,
        examples,
        sftTrainingConfig(spec, baseId, parameterCount(base)),
        validationExamples && { url: validationUrl!, examples: validationExamples, spec },
      );
      microBatchBudget(base.config, kernels, planned.plan.prepared.sequences, 0, base.storage);
      if (planned.validation)
        microBatchBudget(base.config, kernels, planned.validation, 0, base.storage);
      return { base, kernels };
    });
    const { sftConfig, plan, validation } = planned!;
    const { totalSteps } = plan;
    const every = spec.config.checkpoint_every ?? totalSteps;
    const evalAt = validation ? validationSteps(spec.config, totalSteps) : new Set<number>();
    const evaluate = async (step: number, adapter: LoraAdapter): Promise<SftEvalMetrics> => {
      const metrics = evaluateSft(base, adapter, validation!, {
        kernels,
        interrupt,
        ...(sftConfig.microBatchTokens ? { microBatchTokens: sftConfig.microBatchTokens } : {}),
      });
      await held();
      await store.jobs.appendEvent(job.id, "validation", { ...metrics, gradient_step: step });
      return metrics;
    };
    const resume = await this.#resumePoint(job, base, stepFrom);
    await this.#started(job, { num_sequences: totalSteps }, resume?.step ?? 0, resume?.checkpoint);
    const adapter = resume
      ? undefined
      : await this.#startAdapter(
          job,
          base,
          stepFrom,
          sftConfig.lora ?? { baseModel: baseId },
          sftConfig.seed ?? 0,
        );
    // The starting point of the validation curve: the adapter before the first step.
    if (adapter && evalAt.has(0)) await evaluate(0, adapter);
    await trainSft(base, examples, sftConfig, {
      kernels,
      plan,
      signal,
      interrupt,
      ...(adapter ? { adapter } : {}),
      ...(resume ? { resume } : {}),
      onStep: this.#onStep(
        job,
        { stepFrom, totalSteps, every, signal, interrupt, held },
        (step, a) => (evalAt.has(step) ? evaluate(step, a) : Promise.resolve(undefined)),
      ),
    });
    return stepFrom + totalSteps;
  }

  /**
   * An SFT job with `config.method: dpo` (ADR 69): as `#runSft`, on preference pairs, against
   * the job's starting point (the checkpoint at `step_from`; the base model at step 0) as the
   * frozen reference, also when a later run of the job resumes mid-way.
   */
  async #runDpo(
    job: TrainingJob,
    signal: AbortSignal,
    interrupt: () => void,
    held: () => Promise<void>,
  ): Promise<number> {
    const { store } = this.#o;
    const spec = sftJobSpec(job);
    const { stepFrom, baseId } = await this.#stepFrom(job);
    const load = this.#o.loadDpoPairs;
    if (!load) throw new Error("this training worker was started without a loader of DPO pairs");
    const pairs = await load(job.entity, job.payload_ref ?? "").catch((err: unknown) => {
      throw new JobInputError(err instanceof Error ? err.message : String(err));
    });
    let planned: { config: DpoConfig; plan: ReturnType<typeof planDpo> } | undefined;
    const { base, kernels } = await this.#onArena(baseId, async (kernels) => {
      const base = await this.#o.loadBaseModel(baseId, kernels);
      planned ??= this.#planDpo(base, pairs, dpoTrainingConfig(spec, baseId, parameterCount(base)));
      dpoMicroBatchBudget(base, kernels, planned.plan.prepared.pairs, 0);
      return { base, kernels };
    });
    const { config, plan } = planned!;
    const { totalSteps } = plan;
    const every = spec.config.checkpoint_every ?? totalSteps;
    const resume = await this.#resumePoint(job, base, stepFrom);
    await this.#started(job, { num_sequences: totalSteps }, resume?.step ?? 0, resume?.checkpoint);
    // The reference: the checkpoint the job started from, frozen (none: the base itself).
    const start = await store.models.getCheckpoint(job.entity, job.model_id, stepFrom);
    if (!start) throw new JobInputError(`checkpoint step ${stepFrom} of the model is gone`);
    const reference = start.blob_key
      ? adapterFromFiles(await readCheckpointFiles(store.blobs, start.blob_key), base)
      : null;
    const adapter = resume
      ? undefined
      : await this.#startAdapter(
          job,
          base,
          stepFrom,
          config.lora ?? { baseModel: baseId },
          config.seed ?? 0,
        );
    await trainDpo(base, pairs, config, {
      kernels,
      plan,
      signal,
      interrupt,
      reference,
      ...(adapter ? { adapter } : {}),
      ...(resume ? { resume } : {}),
      onStep: this.#onStep(job, { stepFrom, totalSteps, every, signal, interrupt, held }),
    });
    return stepFrom + totalSteps;
  }

  /**
   * What an SFT or DPO job does after each step: checks it is still the job's, counts its
   * tokens, writes its `gradient_step` event, validates when `validate` says (SFT), and saves a
   * checkpoint every `every` steps and at the last.
   */
  #onStep(
    job: TrainingJob,
    at: {
      stepFrom: number;
      totalSteps: number;
      every: number;
      signal: AbortSignal;
      interrupt: () => void;
      held: () => Promise<void>;
    },
    validate?: (step: number, adapter: LoraAdapter) => Promise<SftEvalMetrics | undefined>,
  ) {
    return async (progress: {
      step: number;
      metrics: { num_tokens: number };
      adapter: LoraAdapter;
      optimizerState(): Uint8Array;
    }): Promise<void> => {
      await at.held();
      this.#o.onActivity?.({ type: "tokens", jobType: "sft", tokens: progress.metrics.num_tokens });
      await this.#o.store.jobs.appendEvent(job.id, "gradient_step", { ...progress.metrics });
      const validated = await validate?.(progress.step, progress.adapter);
      if (progress.step % at.every === 0 || progress.step === at.totalSteps) {
        at.interrupt();
        await this.#saveCheckpoint(
          job,
          at.stepFrom + progress.step,
          progress.adapter,
          () => progress.optimizerState(),
          at.signal,
          { ...progress.metrics },
          validated,
        );
      }
    };
  }

  /** A DPO job's plan on `base`, within the limits of a job (a pair counts as an example; its
   * tokens are both answers'). */
  #planDpo(base: Model, pairs: DpoPair[], config: DpoConfig) {
    const epochs = config.epochs ?? 1;
    if (pairs.length * epochs > MAX_JOB_EXAMPLES) {
      throw new JobInputError(
        `The job would train on ${pairs.length} pairs × ${epochs} epochs, more than the limit of ${MAX_JOB_EXAMPLES} per job: use fewer epochs or a smaller dataset.`,
      );
    }
    const plan = planDpo(base, pairs, config);
    if (plan.totalSteps > MAX_JOB_STEPS) {
      throw new JobInputError(
        `The job plans ${plan.totalSteps} steps, more than the limit of ${MAX_JOB_STEPS} per job: use a larger batch_size or fewer epochs.`,
      );
    }
    let tokens = 0;
    for (const p of plan.prepared.pairs)
      tokens += p.chosen.tokens.length + p.rejected.tokens.length;
    if (tokens * epochs > MAX_JOB_TOKENS) {
      throw new JobInputError(
        `The job would process ${tokens * epochs} tokens, more than the limit of ${MAX_JOB_TOKENS} per job: use fewer epochs or a smaller dataset.`,
      );
    }
    return { config, plan };
  }

  /** The job's plan on `base` (what trainSft is handed), within the limits of a job, and its
   * validation set tokenized as training tokenizes (the same mask, cut and turns). */
  #planSft(
    base: Model,
    examples: SftExample[],
    sftConfig: SftConfig,
    validationSet?: { url: string; examples: SftExample[]; spec: SftJobSpec },
  ) {
    // Bounded before planning (a plan holds every step), then again against the plan itself.
    const epochs = sftConfig.epochs ?? 1;
    if (examples.length * epochs > MAX_JOB_EXAMPLES) {
      throw new JobInputError(
        `The job would train on ${examples.length} examples × ${epochs} epochs, more than the limit of ${MAX_JOB_EXAMPLES} per job: use fewer epochs or a smaller dataset.`,
      );
    }
    if (validationSet && validationSet.examples.length > MAX_VALIDATION_EXAMPLES) {
      throw new JobInputError(
        `The validation set (${validationSet.url}) has ${validationSet.examples.length} examples, more than the limit of ${MAX_VALIDATION_EXAMPLES}: validate on a sample of it.`,
      );
    }
    const plan = planSft(base, examples, sftConfig);
    const { totalSteps } = plan;
    if (totalSteps > MAX_JOB_STEPS) {
      throw new JobInputError(
        `The job plans ${totalSteps} steps, more than the limit of ${MAX_JOB_STEPS} per job: use a larger batch_size or fewer epochs.`,
      );
    }
    const tokens = plan.prepared.sequences.reduce((sum, s) => sum + s.tokens.length, 0) * epochs;
    if (tokens > MAX_JOB_TOKENS) {
      throw new JobInputError(
        `The job would process ${tokens} tokens, more than the limit of ${MAX_JOB_TOKENS} per job: use fewer epochs or a smaller dataset.`,
      );
    }
    if (!validationSet) return { sftConfig, plan, validation: undefined };
    let validation: SftSequence[];
    try {
      validation = sftSequences(base, validationSet.examples, sftConfig);
    } catch (err) {
      throw new JobInputError(validationError(validationSet.url, err));
    }
    const perEvaluation = validation.reduce((sum, s) => sum + s.tokens.length, 0);
    if (perEvaluation > MAX_VALIDATION_TOKENS) {
      throw new JobInputError(
        `The validation set (${validationSet.url}) has ${perEvaluation} tokens, more than the limit of ${MAX_VALIDATION_TOKENS}: validate on a sample of it.`,
      );
    }
    const evaluations = validationSteps(validationSet.spec.config, totalSteps).size;
    if (tokens + perEvaluation * evaluations > MAX_JOB_TOKENS) {
      throw new JobInputError(
        `The job would process ${tokens} tokens of training and ${perEvaluation} × ${evaluations} of validation, more than the limit of ${MAX_JOB_TOKENS} per job: use a larger eval_every or a smaller validation set.`,
      );
    }
    return { sftConfig, plan, validation };
  }

  /** After a crash: the last checkpoint this job wrote, with its optimizer state. */
  async #resumePoint(job: TrainingJob, base: Model, stepFrom: number) {
    const latest = await this.#ownCheckpoint(job, stepFrom);
    if (!latest?.blob_key) return undefined;
    const files = await readCheckpointFiles(this.#o.store.blobs, latest.blob_key);
    const optimizerState = files[OPTIMIZER_FILE];
    if (!optimizerState) return undefined;
    this.#o.logger.info({ jobId: job.id, step: latest.step }, "resuming from the last checkpoint");
    return {
      step: latest.step - stepFrom,
      checkpoint: latest.step,
      adapter: adapterFromFiles(files, base),
      optimizerState,
    };
  }

  /** On a later run of a job, the last checkpoint an earlier run of it saved (the model's
   * latest, past the job's start: no other job of the model ran since). */
  async #ownCheckpoint(job: TrainingJob, stepFrom: number) {
    if (job.attempts <= 1) return undefined;
    const latest = await this.#o.store.models.getCheckpoint(job.entity, job.model_id);
    return latest && latest.step > stepFrom ? latest : undefined;
  }

  /**
   * `training_started`. A later run of a job that had started says so: `resumed_from_step` is
   * the last of the job's steps it does not train again (its checkpoint's; 0 without one), and
   * `attempt` the run (the job's claims). The steps after it that an earlier run reported are
   * not reported again (the store keeps the first report). The checkpoint it resumes from is
   * announced again first, in case that run died between listing it and its event (the store
   * drops the repeat).
   */
  async #started(
    job: TrainingJob,
    data: { num_sequences: number; skipped_groups?: number },
    resumedFrom: number,
    checkpoint: number | undefined,
  ): Promise<void> {
    const { jobs } = this.#o.store;
    if (job.attempts <= 1 || !(await jobs.hasEvent(job.id, "training_started"))) {
      await jobs.appendEvent(job.id, "training_started", data);
      return;
    }
    if (checkpoint !== undefined)
      await jobs.appendEvent(job.id, "checkpoint_saved", { step: checkpoint });
    await jobs.appendEvent(job.id, "training_started", {
      ...data,
      resumed_from_step: resumedFrom,
      attempt: job.attempts,
    });
  }

  /** One optimizer step on the job's trajectory groups → checkpoint `step_from + 1`. The Adam
   * moments carry over from the starting checkpoint, so successive RL jobs continue one run. */
  async #runRl(job: TrainingJob, signal: AbortSignal): Promise<number> {
    const { store } = this.#o;
    const { stepFrom, baseId } = await this.#stepFrom(job);
    const { config, learningRate, maxGradNorm, seed, klReferenceStep } = rlStepConfig(
      rlJobSpec(job),
      stepFrom,
    );
    const payload = job.payload_ref ? await this.#o.store.blobs.get(job.payload_ref) : undefined;
    if (!payload) throw new JobInputError("the job's trajectory groups are missing");
    const groups = JSON.parse(payload.toString("utf8")) as TrajectoryGroup[];
    const skipped = groups.filter(
      (g) => new Set(g.trajectories.map((t) => t.reward ?? 0)).size <= 1,
    ).length;
    const started = { num_sequences: 1, skipped_groups: skipped };
    const done = await this.#ownCheckpoint(job, stepFrom);
    if (done) {
      // An earlier run took the step and saved it, then died before ending the job.
      await this.#started(job, started, 1, done.step);
      return done.step;
    }
    await this.#started(job, started, 0, undefined);
    const start = await this.#o.store.models.getCheckpoint(job.entity, job.model_id, stepFrom);
    if (!start) throw new JobInputError(`checkpoint step ${stepFrom} of the model is gone`);
    const files = start.blob_key
      ? await readCheckpointFiles(this.#o.store.blobs, start.blob_key)
      : {};
    // The KL penalty's reference: a checkpoint of the model, or (null) the base model itself.
    let referenceFiles: Record<string, Uint8Array> | null = null;
    if (klReferenceStep !== null) {
      const reference = await store.models.getCheckpoint(job.entity, job.model_id, klReferenceStep);
      if (!reference) {
        throw new JobInputError(
          `the KL reference, checkpoint step ${klReferenceStep} of the model, does not exist (deleted, or never saved)`,
        );
      }
      if (reference.blob_key)
        referenceFiles = await readCheckpointFiles(this.#o.store.blobs, reference.blob_key);
    }
    const { trainer, metrics } = await this.#onArena(baseId, async (kernels) => {
      const base = await this.#o.loadBaseModel(baseId, kernels);
      if (referenceFiles) config.klReference = adapterFromFiles(referenceFiles, base);
      const adapter = start.blob_key
        ? adapterFromFiles(files, base)
        : createLoraAdapter(base, defaultLora(baseId, parameterCount(base)), seed);
      const trainer = new LoraTrainer(base, adapter, { maxGradNorm, kernels });
      const optimizerState = files[OPTIMIZER_FILE];
      if (optimizerState) trainer.loadOptimizerState(optimizerState);
      signal.throwIfAborted();
      // The step checks that it fits the kernels' memory before it computes anything.
      return { trainer, metrics: trainRlStep(trainer, groups, learningRate, config) };
    });
    this.#o.onActivity?.({ type: "tokens", jobType: "rl", tokens: metrics.num_tokens });
    await store.jobs.appendEvent(job.id, "gradient_step", { ...metrics, gradient_step: 1 });
    await this.#saveCheckpoint(
      job,
      stepFrom + 1,
      trainer.adapter,
      () => trainer.optimizerStateToBytes(),
      signal,
      { ...metrics },
    );
    return stepFrom + 1;
  }

  /**
   * Files, then the row, then the event: the checkpoint is listed before anyone hears of it. An
   * adapter with a weight that is not finite or out of bounds (training diverged) is not saved:
   * the job fails naming the tensor, as an upload of it would be refused.
   */
  async #saveCheckpoint(
    job: TrainingJob,
    step: number,
    adapter: LoraAdapter,
    optimizerState: () => Uint8Array,
    signal: AbortSignal,
    metrics: Record<string, unknown> = {},
    validation?: SftEvalMetrics,
  ): Promise<void> {
    const problem = adapterWeightProblem(adapter);
    if (problem) {
      throw new JobInputError(
        `Training diverged by step ${step}: ${problem.message} No checkpoint was saved; a lower learning_rate may help.`,
      );
    }
    const blobs = this.#o.store.blobs;
    const files = { ...adapterToFiles(adapter), [OPTIMIZER_FILE]: optimizerState() };
    const prefix = await writeCheckpointFiles(blobs, job.model_id, step, files);
    if (signal.aborted) {
      await blobs.deletePrefix(prefix);
      signal.throwIfAborted();
    }
    await this.#o.store.models.addCheckpoint(job.entity, job.model_id, {
      step,
      blob_key: prefix,
      metrics: { ...trainMetrics(metrics), ...validationMetrics(validation) },
    });
    await this.#o.store.jobs.appendEvent(job.id, "checkpoint_saved", { step });
  }

  /**
   * Runs `work` (which loads the base model into the kernels it is given) on a wasm32 arena,
   * the faster, unless the base model's jobs needed more than its 4 GiB before; when `work`
   * finds that they do, with an EngineMemoryError before it has done anything, it runs again on
   * a Memory64 arena.
   */
  async #onArena<T>(baseId: string, work: (kernels: Kernels) => Promise<T>): Promise<T> {
    if (!this.#wide.has(baseId)) {
      try {
        return await work(await this.#kernelSet(false));
      } catch (err) {
        if (!(err instanceof EngineMemoryError)) throw err;
        this.#o.logger.info(
          { baseId, needed: err.needed, available: err.available },
          "the job needs more than a wasm32 arena: training on a Memory64 one",
        );
      }
    }
    const result = await work(await this.#kernelSet(true));
    this.#wide.add(baseId);
    return result;
  }

  /**
   * One kernel set at a time for every job of this worker (its helper threads start with the
   * first), wasm32 or Memory64: a switch stops the other's threads and drops it, and its arena
   * goes with the base model in it when collected (WebAssembly memory never shrinks, so only
   * dropping it returns the memory).
   */
  async #kernelSet(memory64: boolean): Promise<Kernels> {
    const old = this.#kernels;
    if (old && old.memory64 !== memory64) {
      this.#kernels = undefined;
      await old
        .close()
        .catch((err: unknown) =>
          this.#o.logger.warn({ err }, "could not stop the kernel threads of the other arena"),
        );
    }
    this.#kernels ??= this.#createKernels(memory64);
    return this.#kernels;
  }
}
