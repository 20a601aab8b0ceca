/**
 * A cancel seen across threads while a training step computes: the supervisor writes the
 * cancelled job's id into shared memory, and the training thread compares it with its job's id
 * between micro-batches (its event loop, and so any message or timer, waits for the step). A
 * fifth word says the worker is stopping (a shutdown): the thread then hands its job back.
 */

/** The shared memory a supervisor and its thread read: four words of a cancelled job's id, and
 * the stopping word. */
export function stopWords(): Int32Array {
  return new Int32Array(new SharedArrayBuffer(5 * 4));
}

const STOPPING = 4;

/** Tells the thread reading `shared` that its worker is stopping. */
export function writeStopping(shared: Int32Array): void {
  if (shared.length > STOPPING) Atomics.store(shared, STOPPING, 1);
}

/** Whether the worker of the thread reading `shared` is stopping. */
export function isStopping(shared: Int32Array | undefined): boolean {
  return shared !== undefined && shared.length > STOPPING && Atomics.load(shared, STOPPING) === 1;
}

/** A job id (a UUID) as the four 32-bit words the shared memory holds. */
export function idWords(id: string): [number, number, number, number] {
  const hex = id.replace(/-/g, "").padEnd(32, "0").slice(0, 32);
  return [0, 1, 2, 3].map((i) => Number.parseInt(hex.slice(i * 8, i * 8 + 8), 16) | 0) as [
    number,
    number,
    number,
    number,
  ];
}

/** Tells the thread reading `cancelled` that job `id` was cancelled. */
export function writeCancelled(cancelled: Int32Array, id: string): void {
  idWords(id).forEach((word, i) => {
    Atomics.store(cancelled, i, word);
  });
}

/** Whether `cancelled` names the job whose id is `words`. */
export function isCancelled(cancelled: Int32Array | undefined, words: readonly number[]): boolean {
  return cancelled !== undefined && words.every((w, i) => Atomics.load(cancelled, i) === w);
}

/** Forgets the cancel `cancelled` holds, when it names the job whose id is `words`: a thread
 * that claims that job again (requeued after its lease lapsed) must not stop on an old cancel. */
export function clearCancelled(cancelled: Int32Array | undefined, words: readonly number[]): void {
  // Word by word, so only when every word is this job's: else it could zero part of another id.
  if (!cancelled || !isCancelled(cancelled, words)) return;
  words.forEach((word, i) => {
    Atomics.compareExchange(cancelled, i, word, 0);
  });
}
