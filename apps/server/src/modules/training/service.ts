import type { components } from "@arbor/spec/schema";
import {
  type JobEvent,
  type JobProgress,
  NotFoundError,
  quote,
  type Store,
  type TrainingJob,
} from "@arbor/store";
import { findOwned, type Principal } from "../access.ts";

type Schemas = components["schemas"];

export const TERMINAL_EVENT_TYPES = new Set(["training_ended", "training_failed"]);

export function jobToWire(
  job: TrainingJob,
  progress: JobProgress | null = null,
): Schemas["TrainingJob"] {
  return {
    id: job.id,
    object: "training_job",
    type: job.type,
    model_id: job.model_id,
    status: job.status === "queued" && job.paused_at !== null ? "paused" : job.status,
    created_at: job.created_at,
    training_start: job.training_start,
    training_end: job.training_end,
    error_message: job.error_message,
    step_from: job.step_from ?? 0,
    step_to: job.step_to,
    // SFT stores `{config, experimental_config}`; RL its experimental_config alone.
    config:
      job.type === "sft"
        ? ((job.config ?? {}) as Record<string, unknown>)
        : { experimental_config: job.config ?? {} },
    progress,
  };
}

/** The store keeps each event's `data` as the runner wrote it, which is the wire's shape for
 * its `type` (the response validator checks the pair). */
export function eventToWire(event: JobEvent): Schemas["TrainingJobEvent"] {
  return {
    id: event.id,
    object: "training_job.event",
    type: event.type,
    data: event.data ?? {},
    created_at: event.created_at,
  } as Schemas["TrainingJobEvent"];
}

/** A job of an entity the principal may use; any other reads as missing. */
export async function findJob(
  store: Store,
  principal: Principal,
  jobId: string,
): Promise<TrainingJob> {
  const job = await findOwned(principal, (entity) => store.jobs.get(entity, jobId));
  if (job) return job;
  throw new NotFoundError(`Training job ${quote(jobId)} not found.`, {
    code: "training_job_not_found",
  });
}

/**
 * A job's events after `after`, then each new one as it is written, until the terminal event or
 * until `signal` aborts (the client left). New events are looked for every `pollMs`.
 */
export async function* followEvents(
  store: Store,
  job: TrainingJob,
  options: { after: string | undefined; pollMs: number; signal: AbortSignal },
): AsyncGenerator<Schemas["TrainingJobEvent"]> {
  let after = options.after;
  while (!options.signal.aborted) {
    const page = await store.jobs.listEvents(job.entity, job.id, { after, limit: 100 });
    for (const event of page.data) {
      yield eventToWire(event);
      after = event.id;
      if (TERMINAL_EVENT_TYPES.has(event.type)) return;
    }
    if (!page.has_more) await sleep(options.pollMs, options.signal);
  }
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const timer = setTimeout(done, ms);
    signal.addEventListener("abort", done, { once: true });
    function done() {
      clearTimeout(timer);
      signal.removeEventListener("abort", done);
      resolve();
    }
  });
}
