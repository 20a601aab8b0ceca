/** A kernel helper thread: instantiates the kernels on the shared arena and claims tasks. */
import { workerData } from "node:worker_threads";
import type { KernelExports } from "../table.ts";
import { MAX_ARGS, runJob } from "./jobs.ts";
import {
  CALLER_SLEEPING,
  claim,
  DONE,
  FAILED,
  READY,
  recordError,
  SEQ,
  SLEEPING,
  SLOT,
  SLOTS_BYTE,
  SPIN_MS,
} from "./pool.ts";

const { module, memory, control, index } = workerData as {
  module: WebAssembly.Module;
  memory: WebAssembly.Memory;
  control: SharedArrayBuffer;
  index: number;
};
const i32 = new Int32Array(control);
const f64 = new Float64Array(control, SLOTS_BYTE);
// A failure here (or to load this module) is reported by the entry that imported it.
const ex = new WebAssembly.Instance(module, { env: { memory } })
  .exports as unknown as KernelExports;
Atomics.add(i32, READY, 1);
Atomics.notify(i32, READY);

let seen = 0;
for (;;) {
  let seq = Atomics.load(i32, SEQ);
  if (seq === seen) {
    const until = performance.now() + SPIN_MS;
    for (let spins = 0; seq === seen; spins++) {
      if ((spins & 255) === 255 && performance.now() > until) {
        Atomics.store(i32, SLEEPING + index, 1);
        Atomics.wait(i32, SEQ, seen);
        Atomics.store(i32, SLEEPING + index, 0);
      }
      seq = Atomics.load(i32, SEQ);
    }
  }
  seen = seq;
  for (;;) {
    const t = claim(i32, seq);
    if (t < 0) break;
    const base = t * SLOT;
    try {
      runJob(ex, f64[base]!, f64.subarray(base + 1, base + 1 + MAX_ARGS));
    } catch (error) {
      Atomics.store(i32, FAILED, 1);
      recordError(i32, error);
    } finally {
      Atomics.add(i32, DONE, 1);
      if (Atomics.load(i32, CALLER_SLEEPING) === 1) Atomics.notify(i32, DONE);
    }
  }
}
