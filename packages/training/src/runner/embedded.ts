import { once } from "node:events";
import { Worker } from "node:worker_threads";
import type { Store } from "@arbor/store";
import type { Logger } from "pino";
import { stopWords, writeCancelled, writeStopping } from "./cancel.ts";
import { dataDirIdentity, type WorkerIdentity } from "./identity.ts";
import type { TrainingActivity } from "./runner.ts";
import type { ThreadData, ThreadReport, WorkerThreadSettings } from "./thread.ts";

export interface EmbeddedWorkerOptions extends WorkerThreadSettings {
  /** Training threads, each running one job at a time (jobs of different models run side by
   * side). Default 1. */
  threads?: number;
  /** The supervisor's own store handle: it fails the job of a thread that died. */
  store: Store;
  logger: Logger;
  /** First pause before a dead thread is started again; doubles per death, at most 30 s. */
  restartDelayMs?: number;
  /** The module each thread runs (default `./thread.ts`); tests give a stand-in. */
  threadModule?: URL;
  /** Told of the threads' work, for metrics; the job of a thread that died ends as failed. */
  onActivity?: (activity: TrainingActivity) => void;
  /** How often the supervisor reads whether its threads' jobs are still theirs (default 500 ms):
   * a cancel made by another process (a replica's API, a deleted model) then reaches the thread
   * between micro-batches, not only after the step in flight. */
  cancelPollMs?: number;
  /** How long a thread told to stop its job (cancelled, deleted, no longer its own, or the
   * worker stopping) may take before it is ended (default 2000 ms): a micro-batch of a large
   * model, or loading one, can compute for longer than that without looking at the word. On a
   * stop, the supervisor then hands the job back itself, so a shutdown never counts as a crash. */
  stopWithinMs?: number;
  /** Who the threads are (default: this data directory's identity); a worker process with
   * `ARBOR_WORKER_ID` names itself. */
  identity?: WorkerIdentity;
}

type SlotState = "starting" | "running" | "restarting" | "stopped";

/** One supervised training thread. */
class Slot {
  readonly index: number;
  state: SlotState = "starting";
  thread: Worker | undefined;
  workerId: string | undefined;
  job: string | null = null;
  jobType: "sft" | "rl" = "sft";
  /** When the thread said it started `job` (performance.now()). */
  jobStarted = 0;
  deaths = 0;
  lastError: string | null = null;
  timer: NodeJS.Timeout | undefined;
  /** Armed when the slot's job was told to stop: the thread is ended if it has not by then. */
  stopTimer: NodeJS.Timeout | undefined;
  /** The thread was ended on purpose (its job stopped elsewhere), not by a crash. */
  ended = false;
  /** Shared with the slot's thread (each new thread of the slot gets the same memory): a
   * cancelled job's id, and whether the worker is stopping. */
  readonly cancelled = stopWords();
  constructor(index: number) {
    this.index = index;
  }
}

/** Health of the embedded worker, for `/v1/system-check`. */
export interface WorkerHealth {
  success: boolean;
  error: string | null;
  threads: number;
  running: number;
}

/**
 * The training worker on threads of the server's process, supervised: a thread that dies is
 * logged with its cause, the job it ran fails with a terminal event naming that cause, and a
 * fresh thread starts (after a pause that grows with repeated deaths). `stop()` hands running
 * jobs back to the queue and waits for the threads to close their stores.
 */
export class EmbeddedWorker {
  readonly #options: EmbeddedWorkerOptions;
  readonly #identity: WorkerIdentity;
  readonly #slots: Slot[];
  #stopping = false;
  #watcher: NodeJS.Timeout | undefined;
  #watching = false;

  private constructor(options: EmbeddedWorkerOptions, identity: WorkerIdentity) {
    this.#options = options;
    this.#identity = identity;
    this.#slots = Array.from({ length: Math.max(1, options.threads ?? 1) }, (_, i) => new Slot(i));
  }

  static async start(options: EmbeddedWorkerOptions): Promise<EmbeddedWorker> {
    const worker = new EmbeddedWorker(
      options,
      options.identity ?? dataDirIdentity(options.dataDir),
    );
    try {
      await Promise.all(worker.#slots.map((slot) => worker.#startSlot(slot)));
    } catch (err) {
      await worker.stop();
      throw err;
    }
    worker.#watcher = setInterval(() => void worker.#watch(), options.cancelPollMs ?? 500);
    worker.#watcher.unref();
    return worker;
  }

  /** Tells each thread whose job is no longer its own (cancelled or deleted anywhere, or its
   * lease taken back) to stop now: one indexed read per running job. */
  async #watch(): Promise<void> {
    // One read per job at a time: a slow database does not pile the reads up.
    if (this.#watching) return;
    this.#watching = true;
    try {
      await this.#watchSlots();
    } finally {
      this.#watching = false;
    }
  }

  async #watchSlots(): Promise<void> {
    for (const slot of this.#slots) {
      const { job, workerId } = slot;
      if (!job || !workerId) continue;
      try {
        if (!(await this.#options.store.jobs.stillHeld(workerId, job)) && slot.job === job) {
          writeCancelled(slot.cancelled, job);
          this.#stopWithin(slot, job);
        }
      } catch (err) {
        // The thread's own lease renewal notices a lost job too, after its step.
        this.#options.logger.debug({ err, jobId: job }, "could not read whether the job is held");
      }
    }
  }

  /** A job was cancelled (or its model deleted) in this process: the thread running it stops
   * within the step it is in, instead of at its next lease renewal after the step. */
  cancelled(jobId: string): void {
    for (const slot of this.#slots) {
      writeCancelled(slot.cancelled, jobId);
      if (slot.job === jobId) this.#stopWithin(slot, jobId);
    }
  }

  /** Ends the slot's thread if it still runs `job` after `stopWithinMs`: a step that does not
   * reach its next micro-batch in time is cut off. The job's row already says it stopped. */
  #stopWithin(slot: Slot, job: string): void {
    if (slot.stopTimer) return;
    slot.stopTimer = setTimeout(() => {
      slot.stopTimer = undefined;
      const thread = slot.thread;
      if (this.#stopping || slot.job !== job || !thread) return;
      this.#options.logger.info(
        { thread: slot.index, jobId: job },
        "the training thread did not stop its job in time: ending it and starting a fresh one",
      );
      slot.ended = true;
      void thread.terminate();
    }, this.#options.stopWithinMs ?? 2000);
    slot.stopTimer.unref();
  }

  /** The jobs the threads run now. */
  running(): string[] {
    return this.#slots.flatMap((s) => (s.job ? [s.job] : []));
  }

  /** A job was just queued: the threads look now rather than at their next poll. */
  poke(): void {
    for (const slot of this.#slots) slot.thread?.postMessage("poke");
  }

  health(): WorkerHealth {
    const running = this.#slots.filter((s) => s.state === "running").length;
    const down = this.#slots.filter((s) => s.state !== "running");
    return {
      success: down.length === 0,
      error:
        down.length === 0
          ? null
          : down
              .map(
                (s) =>
                  `training thread ${s.index} is ${s.state}${s.lastError ? ` after: ${s.lastError}` : ""}`,
              )
              .join("; "),
      threads: this.#slots.length,
      running,
    };
  }

  /**
   * Stops every thread, its running job handed back to the queue to resume from its last
   * checkpoint, as a graceful stop (a deploy) never counts against a job's restarts: the thread
   * hands it back between micro-batches, or, when it does not stop within `stopWithinMs` (a
   * long micro-batch, a model loading), it is ended and the supervisor hands the job back.
   */
  async stop(): Promise<void> {
    this.#stopping = true;
    clearInterval(this.#watcher);
    for (const slot of this.#slots) clearTimeout(slot.stopTimer);
    await Promise.all(
      this.#slots.map(async (slot) => {
        clearTimeout(slot.timer);
        const thread = slot.thread;
        slot.state = "stopped";
        if (!thread) return;
        let timer: NodeJS.Timeout | undefined;
        const stopped = new Promise<boolean>((resolve) => {
          thread.on("message", (m: ThreadReport) => m.type === "stopped" && resolve(true));
          thread.once("exit", () => resolve(true));
          timer = setTimeout(() => resolve(false), this.#options.stopWithinMs ?? 2000);
        });
        writeStopping(slot.cancelled);
        thread.postMessage("stop");
        const inTime = await stopped;
        clearTimeout(timer);
        await thread.terminate();
        const { job, workerId } = slot;
        if (inTime || !job || !workerId) return;
        const released = await this.#options.store.jobs
          .releaseJob(workerId, job)
          .catch((err: unknown) => {
            this.#options.logger.warn({ err, jobId: job }, "could not hand the job back");
            return false;
          });
        this.#options.logger.info(
          { thread: slot.index, jobId: job, released },
          "the training thread did not stop in time: ended, its job handed back to the queue",
        );
      }),
    );
    this.#identity.release();
  }

  /** Starts the slot's thread and resolves once it reports that it runs. */
  async #startSlot(slot: Slot): Promise<void> {
    const {
      store,
      logger,
      threads,
      restartDelayMs,
      threadModule,
      onActivity,
      cancelPollMs,
      stopWithinMs,
      identity: _,
      ...settings
    } = this.#options;
    const identity = {
      stable: `${this.#identity.stable}.${slot.index}`,
      persistent: this.#identity.persistent,
    };
    const thread = new Worker(threadModule ?? new URL("./thread.ts", import.meta.url), {
      workerData: { ...settings, identity, cancelled: slot.cancelled } satisfies ThreadData,
    });
    slot.thread = thread;
    slot.state = "starting";
    slot.job = null;
    let error: Error | undefined;
    thread.on("error", (err) => {
      error = err;
    });
    thread.on("message", (message: ThreadReport) => {
      if (message.type === "job") {
        slot.job = message.jobId;
        if (message.jobType) slot.jobType = message.jobType;
        slot.jobStarted = performance.now();
        clearTimeout(slot.stopTimer);
        slot.stopTimer = undefined;
      }
      if (message.type === "activity") onActivity?.(message.activity);
    });
    thread.once("exit", (code) => void this.#died(slot, thread, error, code));
    const [started] = (await Promise.race([
      once(thread, "message"),
      once(thread, "exit").then(() =>
        Promise.reject(error ?? new Error("the training worker thread exited while starting")),
      ),
    ])) as [ThreadReport];
    if (started.type !== "started")
      throw new Error(`the training worker thread did not start: ${JSON.stringify(started)}`);
    slot.workerId = started.workerId;
    slot.state = "running";
  }

  async #died(slot: Slot, thread: Worker, error: Error | undefined, code: number): Promise<void> {
    if (slot.thread !== thread || this.#stopping) return;
    const cause = error?.message ?? `exit code ${code}`;
    const { logger, store } = this.#options;
    if (slot.ended) {
      // Ended on purpose: its job was stopped elsewhere (the row says so), nothing failed.
      slot.ended = false;
      slot.thread = undefined;
      slot.state = "restarting";
      const job = slot.job;
      slot.job = null;
      if (job)
        this.#options.onActivity?.({
          type: "ended",
          jobType: slot.jobType,
          outcome: "cancelled",
          seconds: (performance.now() - slot.jobStarted) / 1000,
        });
      this.#startSlot(slot).then(
        () => logger.info({ thread: slot.index }, "training worker thread started afresh"),
        () => {},
      );
      return;
    }
    slot.deaths++;
    slot.lastError = cause;
    slot.state = "restarting";
    slot.thread = undefined;
    const job = slot.job;
    slot.job = null;
    logger.error(
      { err: error, code, thread: slot.index, jobId: job },
      `training worker thread ${slot.index} died: ${cause}`,
    );
    if (job && slot.workerId) {
      const message = `The training worker died while running this job: ${cause}`;
      await store.jobs.failJob(slot.workerId, job, message).then(
        (job) =>
          this.#options.onActivity?.({
            type: "ended",
            jobType: job.type,
            outcome: "failed",
            seconds: (performance.now() - slot.jobStarted) / 1000,
          }),
        (err: unknown) =>
          logger.warn({ err, jobId: job }, "could not fail the job of a dead training thread"),
      );
    }
    const delay = Math.min(30_000, (this.#options.restartDelayMs ?? 1000) * 2 ** (slot.deaths - 1));
    slot.timer = setTimeout(() => {
      if (this.#stopping) return;
      // A thread that dies while starting is handled by its own exit, like any other death.
      this.#startSlot(slot).then(
        () => logger.info({ thread: slot.index }, "training worker thread restarted"),
        () => {},
      );
    }, delay);
  }
}
