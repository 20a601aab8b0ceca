import { Worker } from "node:worker_threads";
import { type JobExports, MAX_ARGS, runJob } from "./jobs.ts";

/** Layout of the control block (Int32 indices; job slots are Float64 after byte 256). */
export const SEQ = 0;
export const DONE = 1;
export const FAILED = 2;
export const READY = 3;
export const SLEEPING = 4;
export const SLOTS_BYTE = 256;
export const SLOT = MAX_ARGS + 1;
/** How long `run` waits for helpers to start before it gives up, in ms. */
const START_TIMEOUT_MS = 60_000;
/** How long a helper spins for the next job before it sleeps on a futex, in ms. */
export const SPIN_MS = 1;

export interface Job {
  op: number;
  args: number[];
}

/**
 * Helper threads that run kernel jobs on the caller's shared WebAssembly.Memory. `run` hands
 * one job to every helper, runs the first itself, and returns when all are done: between
 * calls the arena belongs to the calling thread alone. Helpers spin briefly for the next job,
 * then sleep in Atomics.wait; they are unref'd, so they never keep a process alive.
 */
export class ThreadPool {
  readonly helpers: number;
  private readonly i32: Int32Array;
  private readonly f64: Float64Array;
  private readonly workers: Worker[] = [];
  private seq = 0;
  private started = false;
  private failure: unknown = null;

  constructor(module: WebAssembly.Module, memory: WebAssembly.Memory, helpers: number) {
    this.helpers = helpers;
    const control = new SharedArrayBuffer(SLOTS_BYTE + (helpers + 1) * SLOT * 8);
    this.i32 = new Int32Array(control);
    this.f64 = new Float64Array(control, SLOTS_BYTE);
    for (let index = 0; index < helpers; index++) {
      const worker = new Worker(new URL("./pool-worker.ts", import.meta.url), {
        workerData: { module, memory, control, index },
      });
      worker.on("error", (error) => {
        this.failure = error;
      });
      worker.unref();
      this.workers.push(worker);
    }
  }

  /** Runs jobs[0] here and jobs[1 + i] on helper i (one job per helper, exactly). */
  run(local: JobExports, jobs: readonly Job[]): void {
    if (jobs.length !== this.helpers + 1) throw new Error("thread pool: one job per thread");
    if (this.failure) throw new Error("thread pool: a helper thread died", { cause: this.failure });
    if (!this.started) this.awaitStart();
    for (let i = 1; i < jobs.length; i++) {
      const base = i * SLOT;
      const job = jobs[i]!;
      this.f64[base] = job.op;
      for (let a = 0; a < job.args.length; a++) this.f64[base + 1 + a] = job.args[a]!;
    }
    Atomics.store(this.i32, DONE, 0);
    Atomics.store(this.i32, FAILED, 0);
    this.seq = (this.seq + 1) | 0;
    Atomics.store(this.i32, SEQ, this.seq);
    for (let i = 0; i < this.helpers; i++) {
      if (Atomics.load(this.i32, SLEEPING + i) === 1) {
        Atomics.notify(this.i32, SEQ);
        break;
      }
    }
    let error: unknown = null;
    try {
      runJob(local, jobs[0]!.op, jobs[0]!.args);
    } catch (e) {
      error = e;
    }
    while (Atomics.load(this.i32, DONE) < this.helpers) {
      if (this.failure)
        throw new Error("thread pool: a helper thread died", { cause: this.failure });
    }
    if (error) throw error;
    if (Atomics.load(this.i32, FAILED) !== 0)
      throw new Error("thread pool: a kernel job failed on a helper thread");
  }

  /** Blocks until every helper has instantiated the kernels (the first run only). */
  private awaitStart(): void {
    const deadline = performance.now() + START_TIMEOUT_MS;
    for (;;) {
      const ready = Atomics.load(this.i32, READY);
      if (ready >= this.helpers) break;
      const left = deadline - performance.now();
      if (left <= 0) throw new Error("thread pool: helper threads did not start");
      Atomics.wait(this.i32, READY, ready, Math.min(left, 100));
    }
    this.started = true;
  }

  /** Stops the helpers (they are unref'd, so this is only needed to free them early). */
  async close(): Promise<void> {
    await Promise.all(this.workers.map((w) => w.terminate()));
  }
}
