import { Worker } from "node:worker_threads";
import { type JobExports, MAX_ARGS, runJob } from "./jobs.ts";

/** Layout of the control block: Int32 words, then task slots of Float64 from SLOTS_BYTE. */
export const SEQ = 0;
/** The call's tag and next task index, (tag << 8) | index, claimed by compareExchange. */
export const CLAIM = 1;
/** Tasks in the current call. */
export const COUNT = 2;
/** Tasks finished. */
export const DONE = 3;
export const FAILED = 4;
export const READY = 5;
/** 1 while the calling thread sleeps waiting for DONE. */
export const CALLER_SLEEPING = 6;
/** Per helper: 1 while it sleeps waiting for SEQ. */
export const SLEEPING = 8;
export const MAX_HELPERS = 56;
export const SLOTS_BYTE = 256;
export const SLOT = MAX_ARGS + 1;
export const MAX_TASKS = 255;
/** How long `run` waits for helpers to start before it gives up, in ms. */
const START_TIMEOUT_MS = 60_000;
/** How long a helper spins for the next call before it sleeps on a futex, in ms. */
export const SPIN_MS = 1;
/** How long the caller spins for helpers' last tasks before it sleeps, in ms. */
const CALLER_SPIN_MS = 0.5;

export interface Job {
  op: number;
  args: number[];
}

/**
 * Helper threads that run kernel tasks on the caller's shared WebAssembly.Memory. `run`
 * publishes a call's tasks; the caller and every awake helper claim them one at a time
 * (Atomics.add on a counter) until none are left, and `run` returns when all are done, so
 * between calls the arena belongs to the calling thread alone. A helper that is not scheduled
 * (more threads than free cores) only leaves its tasks to the others: nobody waits for it
 * unless it holds a task. Helpers spin briefly for the next call, then sleep in Atomics.wait;
 * they are unref'd, so they never keep a process alive.
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
    if (helpers > MAX_HELPERS) throw new Error(`thread pool: at most ${MAX_HELPERS} helpers`);
    this.helpers = helpers;
    const control = new SharedArrayBuffer(SLOTS_BYTE + MAX_TASKS * SLOT * 8);
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

  /** Runs the tasks on this thread and the helpers (in any order) and waits for them all. */
  run(local: JobExports, tasks: readonly Job[]): void {
    if (tasks.length > MAX_TASKS) throw new Error(`thread pool: at most ${MAX_TASKS} tasks`);
    if (this.failure) throw new Error("thread pool: a helper thread died", { cause: this.failure });
    if (!this.started) this.awaitStart();
    const { i32, f64 } = this;
    tasks.forEach((task, t) => {
      const base = t * SLOT;
      f64[base] = task.op;
      for (let a = 0; a < task.args.length; a++) f64[base + 1 + a] = task.args[a]!;
    });
    this.seq = (this.seq + 1) & 0x7fffff;
    Atomics.store(i32, COUNT, tasks.length);
    Atomics.store(i32, DONE, 0);
    Atomics.store(i32, FAILED, 0);
    Atomics.store(i32, CLAIM, this.seq << 8);
    Atomics.store(i32, SEQ, this.seq);
    for (let i = 0; i < this.helpers; i++) {
      if (Atomics.load(i32, SLEEPING + i) === 1) {
        Atomics.notify(i32, SEQ);
        break;
      }
    }
    let error: unknown = null;
    for (;;) {
      const t = claim(i32, this.seq, tasks.length);
      if (t < 0) break;
      try {
        runJob(local, tasks[t]!.op, tasks[t]!.args);
      } catch (e) {
        error ??= e;
      }
      Atomics.add(i32, DONE, 1);
    }
    // Wait for tasks still running on helpers: spin a little, then sleep until one finishes.
    const until = performance.now() + CALLER_SPIN_MS;
    for (let done = Atomics.load(i32, DONE), spins = 0; done < tasks.length; spins++) {
      if ((spins & 63) === 63 && performance.now() > until) {
        if (this.failure)
          throw new Error("thread pool: a helper thread died", { cause: this.failure });
        Atomics.store(i32, CALLER_SLEEPING, 1);
        Atomics.wait(i32, DONE, done, 10);
        Atomics.store(i32, CALLER_SLEEPING, 0);
      }
      done = Atomics.load(i32, DONE);
    }
    if (error) throw error;
    if (Atomics.load(i32, FAILED) !== 0)
      throw new Error("thread pool: a kernel task failed on a helper thread");
  }

  /** Blocks until every helper has instantiated the kernels (the first run only). */
  private awaitStart(): void {
    const deadline = performance.now() + START_TIMEOUT_MS;
    for (;;) {
      const ready = Atomics.load(this.i32, READY);
      if (ready >= this.helpers) break;
      if (this.failure)
        throw new Error("thread pool: a helper thread died", { cause: this.failure });
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

/**
 * Claims the next task of call `seq` (of `count` tasks): its index, or −1 when none is left or
 * the call is over. Tagging the counter with the call means a thread that wakes late can
 * never claim a task of a later call as if it were of its own.
 */
export function claim(i32: Int32Array, seq: number, count: number): number {
  for (;;) {
    const current = Atomics.load(i32, CLAIM);
    if (current >>> 8 !== seq) return -1;
    const t = current & 0xff;
    if (t >= count) return -1;
    if (Atomics.compareExchange(i32, CLAIM, current, current + 1) === current) return t;
  }
}
