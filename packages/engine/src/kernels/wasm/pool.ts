import { Worker } from "node:worker_threads";
import type { KernelExports } from "../table.ts";
import { type Job, MAX_ARGS, runJob } from "./jobs.ts";

/**
 * Layout of the control block: Int32 words; from ERROR_BYTE, the first error's text (UTF-8,
 * length in ERROR_LENGTH); task slots of Float64 from SLOTS_BYTE.
 */
export const SEQ = 0;
/**
 * The call in one word, claimed by compareExchange: (tag << 16) | (tasks << 8) | next index.
 * One word means a thread always sees a call's tag, size and progress together.
 */
export const CLAIM = 1;
/** Tasks finished. */
export const DONE = 3;
export const FAILED = 4;
export const READY = 5;
/** 1 while the calling thread sleeps waiting for DONE. */
export const CALLER_SLEEPING = 6;
/** Helpers that failed to start (they count as READY too, so the caller stops waiting). */
export const START_FAILED = 7;
/** Bytes of error text at ERROR_BYTE (0: none). */
export const ERROR_LENGTH = 9;
/** Per helper: 1 while it sleeps waiting for SEQ. */
export const SLEEPING = 16;
export const MAX_HELPERS = 112;
export const ERROR_BYTE = 512;
const ERROR_BYTES = 1024;
export const SLOTS_BYTE = ERROR_BYTE + ERROR_BYTES;
export const SLOT = MAX_ARGS + 1;
export const MAX_TASKS = 255;
/** How long `run` waits for helpers to start before it gives up, in ms. */
const START_TIMEOUT_MS = 60_000;
/** How long a helper spins for the next call before it sleeps on a futex, in ms. */
export const SPIN_MS = 1;
/** How long the caller spins for helpers' last tasks before it sleeps, in ms. */
const CALLER_SPIN_MS = 0.5;

const HELPER_ENTRY = `
const { workerData } = require("node:worker_threads");
import(workerData.script).catch((error) => {
  const i32 = new Int32Array(workerData.control);
  let message = "a helper thread failed (its error could not be printed)";
  try {
    message = String((error && error.stack) || error);
  } catch {}
  const text = new TextEncoder().encode(message).subarray(0, ${ERROR_BYTES});
  if (Atomics.compareExchange(i32, ${ERROR_LENGTH}, 0, -1) === 0) {
    new Uint8Array(workerData.control, ${ERROR_BYTE}, text.length).set(text);
    Atomics.store(i32, ${ERROR_LENGTH}, text.length);
  }
  Atomics.add(i32, ${START_FAILED}, 1);
  Atomics.add(i32, ${READY}, 1);
  Atomics.notify(i32, ${READY});
});`;

/**
 * Helper threads that run kernel tasks on the caller's shared WebAssembly.Memory. `run`
 * publishes a call's tasks; the caller and every awake helper claim them one at a time
 * (compare-and-swap on a counter tagged with the call) until none are left, and `run` returns when all are done, so
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
  private closed = false;
  private failure: unknown = null;

  constructor(
    module: WebAssembly.Module,
    memory: WebAssembly.Memory,
    helpers: number,
    script: URL = new URL("./pool-worker.ts", import.meta.url),
  ) {
    if (helpers > MAX_HELPERS) throw new Error(`thread pool: at most ${MAX_HELPERS} helpers`);
    this.helpers = helpers;
    const control = new SharedArrayBuffer(SLOTS_BYTE + MAX_TASKS * SLOT * 8);
    this.i32 = new Int32Array(control);
    this.f64 = new Float64Array(control, SLOTS_BYTE);
    for (let index = 0; index < helpers; index++) {
      // A small CommonJS entry imports the helper module, so that even a failure to load it
      // reaches the control block (the caller blocks on it and cannot see error events).
      const worker = new Worker(HELPER_ENTRY, {
        eval: true,
        workerData: { module, memory, control, index, script: script.href },
      });
      worker.on("error", (error) => {
        this.failure = error;
      });
      worker.unref();
      this.workers.push(worker);
    }
  }

  /** Runs the tasks on this thread and the helpers (in any order) and waits for them all. */
  run(local: KernelExports, tasks: readonly Job[]): void {
    if (this.closed) throw new Error("thread pool: closed");
    if (tasks.length > MAX_TASKS) throw new Error(`thread pool: at most ${MAX_TASKS} tasks`);
    if (this.failure) throw new Error("thread pool: a helper thread died", { cause: this.failure });
    if (!this.started) this.awaitStart();
    this.checkHelpers();
    const { i32, f64 } = this;
    tasks.forEach((task, t) => {
      if (task.args.length > MAX_ARGS)
        throw new Error(`thread pool: at most ${MAX_ARGS} arguments`);
      const base = t * SLOT;
      f64[base] = task.op;
      for (let a = 0; a < task.args.length; a++) f64[base + 1 + a] = task.args[a]!;
    });
    this.seq = (this.seq + 1) & 0x7fff;
    Atomics.store(i32, DONE, 0);
    Atomics.store(i32, FAILED, 0);
    Atomics.store(i32, ERROR_LENGTH, 0);
    Atomics.store(i32, CLAIM, (this.seq << 16) | (tasks.length << 8));
    Atomics.store(i32, SEQ, this.seq);
    for (let i = 0; i < this.helpers; i++) {
      if (Atomics.load(i32, SLEEPING + i) === 1) {
        Atomics.notify(i32, SEQ);
        break;
      }
    }
    let error: unknown = null;
    for (;;) {
      const t = claim(i32, this.seq);
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
        // A helper's own loop never throws (task errors are caught); one that failed anyway
        // was counted by its entry in START_FAILED.
        this.checkHelpers();
        Atomics.store(i32, CALLER_SLEEPING, 1);
        Atomics.wait(i32, DONE, done, 10);
        Atomics.store(i32, CALLER_SLEEPING, 0);
      }
      done = Atomics.load(i32, DONE);
    }
    if (error) throw error;
    if (Atomics.load(i32, FAILED) !== 0)
      throw new Error(`thread pool: a kernel task failed on a helper thread: ${this.errorText()}`);
  }

  /** Blocks until every helper has instantiated the kernels (the first run only). */
  private awaitStart(): void {
    const deadline = performance.now() + START_TIMEOUT_MS;
    for (;;) {
      const ready = Atomics.load(this.i32, READY);
      if (Atomics.load(this.i32, START_FAILED) > 0)
        throw new Error(`thread pool: a helper thread failed to start: ${this.errorText()}`);
      if (this.failure)
        throw new Error("thread pool: a helper thread died", { cause: this.failure });
      if (ready >= this.helpers) break;
      if (this.failure)
        throw new Error("thread pool: a helper thread died", { cause: this.failure });
      const left = deadline - performance.now();
      if (left <= 0) throw new Error("thread pool: helper threads did not start");
      Atomics.wait(this.i32, READY, ready, Math.min(left, 100));
    }
    this.started = true;
  }

  /** Throws if a helper thread has failed (the pool is then unusable). */
  private checkHelpers(): void {
    if (Atomics.load(this.i32, START_FAILED) > 0)
      throw new Error(`thread pool: a helper thread failed: ${this.errorText()}`);
  }

  /** The first error a helper recorded. */
  private errorText(): string {
    let length = Atomics.load(this.i32, ERROR_LENGTH);
    // −1 while another thread writes it.
    for (let spins = 0; length < 0 && spins < 1_000_000; spins++)
      length = Atomics.load(this.i32, ERROR_LENGTH);
    length = Math.max(0, length);
    const bytes = new Uint8Array(this.i32.buffer, ERROR_BYTE, length).slice();
    return new TextDecoder().decode(bytes) || "unknown error";
  }

  /** Stops the helpers (they are unref'd, so this is only needed to free them early). */
  async close(): Promise<void> {
    this.closed = true;
    await Promise.all(this.workers.map((w) => w.terminate()));
  }
}

/**
 * Claims the next task of call `tag`: its index, or −1 when none is left or another call is
 * published. A thread that wakes late cannot take a task of a later call as its own: the tag
 * no longer matches. (After 32,768 calls a tag comes round again; a thread that slept that
 * long and matches claims a real, unclaimed task of the current call, which is still right.)
 */
export function claim(i32: Int32Array, tag: number): number {
  for (;;) {
    const word = Atomics.load(i32, CLAIM);
    if (word >>> 16 !== tag) return -1;
    const t = word & 0xff;
    if (t >= ((word >>> 8) & 0xff)) return -1;
    if (Atomics.compareExchange(i32, CLAIM, word, word + 1) === word) return t;
  }
}

/** Records `error`'s text in the control block unless an earlier error is there. */
export function recordError(i32: Int32Array, error: unknown): void {
  let text = "a kernel task failed (its error could not be printed)";
  try {
    text = error instanceof Error ? `${error.name}: ${error.message}` : String(error);
  } catch {}
  const bytes = new TextEncoder().encode(text).subarray(0, ERROR_BYTES);
  if (Atomics.compareExchange(i32, ERROR_LENGTH, 0, -1) !== 0) return;
  new Uint8Array(i32.buffer, ERROR_BYTE, bytes.length).set(bytes);
  Atomics.store(i32, ERROR_LENGTH, bytes.length);
}
