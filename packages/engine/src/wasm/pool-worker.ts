/** A kernel helper thread: instantiates the kernels on the shared arena and runs jobs. */
import { workerData } from "node:worker_threads";
import { type JobExports, MAX_ARGS, runJob } from "./jobs.ts";
import { DONE, FAILED, READY, SEQ, SLEEPING, SLOT, SLOTS_BYTE, SPIN_MS } from "./pool.ts";

const { module, memory, control, index } = workerData as {
  module: WebAssembly.Module;
  memory: WebAssembly.Memory;
  control: SharedArrayBuffer;
  index: number;
};
const ex = new WebAssembly.Instance(module, { env: { memory } }).exports as unknown as JobExports;
const i32 = new Int32Array(control);
const base = (index + 1) * SLOT;
const slot = new Float64Array(control, SLOTS_BYTE + base * 8, SLOT);
const args = slot.subarray(1, 1 + MAX_ARGS);

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
  try {
    runJob(ex, slot[0]!, args);
  } catch {
    Atomics.store(i32, FAILED, 1);
  }
  Atomics.add(i32, DONE, 1);
}
