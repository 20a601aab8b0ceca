import { once } from "node:events";
import { Worker } from "node:worker_threads";
import type { WorkerThreadSettings } from "./thread.ts";

/** The training worker on a thread of the server's process; `stop()` hands a running job back
 * to the queue and waits for the thread to close its store. */
export class EmbeddedWorker {
  readonly #thread: Worker;

  private constructor(thread: Worker) {
    this.#thread = thread;
  }

  static async start(settings: WorkerThreadSettings): Promise<EmbeddedWorker> {
    const thread = new Worker(new URL("./thread.ts", import.meta.url), { workerData: settings });
    const [message] = (await Promise.race([
      once(thread, "message"),
      once(thread, "error").then(([err]) => Promise.reject(err)),
    ])) as [unknown];
    if (message !== "started")
      throw new Error(`the training worker thread did not start: ${String(message)}`);
    return new EmbeddedWorker(thread);
  }

  /** A job was just queued: look now rather than at the next poll. */
  poke(): void {
    this.#thread.postMessage("poke");
  }

  async stop(): Promise<void> {
    const stopped = once(this.#thread, "message");
    this.#thread.postMessage("stop");
    await Promise.race([stopped, once(this.#thread, "exit")]);
    await this.#thread.terminate();
  }
}
