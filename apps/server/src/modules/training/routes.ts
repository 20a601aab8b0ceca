import { type Store, TERMINAL_STATUSES } from "@arbor/store";
import { ApiError } from "../../http/errors.ts";
import { type Handlers, RESPONDED } from "../../http/operations.ts";
import { SseWriter } from "../../http/sse.ts";
import {
  createRlJob,
  createSftJob,
  eventToWire,
  findJob,
  jobToWire,
  TERMINAL_EVENT_TYPES,
} from "./service.ts";

export interface TrainingDeps {
  store: Store;
  /** How often a live follower looks for new events. */
  followPollMs?: number;
  onJobQueued?: () => void;
}

/** Training jobs and their events (CONTRACT §5). */
export function trainingHandlers(deps: TrainingDeps): Handlers {
  const { store } = deps;
  const pollMs = deps.followPollMs ?? 200;
  const queued = <T>(job: T): T => {
    deps.onJobQueued?.();
    return job;
  };
  return {
    createRlTrainingJob: async ({ body, principal }) =>
      queued(await createRlJob(store, principal!, body)),
    createSftTrainingJob: async ({ body, principal }) =>
      queued(await createSftJob(store, principal!, body)),
    retrieveTrainingJob: async ({ params, principal }) =>
      jobToWire(await findJob(store, principal!, params.training_job_id)),

    cancelTrainingJob: async ({ params, principal }) => {
      const job = await findJob(store, principal!, params.training_job_id);
      if (TERMINAL_STATUSES.includes(job.status)) {
        throw ApiError.conflict(
          `Training job ${job.id} already ended (${job.status}).`,
          "job_already_ended",
        );
      }
      return jobToWire(await store.jobs.cancelJob(job.entity, job.id));
    },

    listTrainingJobEvents: async ({ params, query, principal, req, res }) => {
      const job = await findJob(store, principal!, params.training_job_id);
      if (req.accepts(["application/json", "text/event-stream"]) !== "text/event-stream") {
        const page = await store.jobs.listEvents(job.entity, job.id, {
          after: query.after,
          limit: query.limit ?? 20,
        });
        return {
          object: "list",
          data: page.data.map(eventToWire),
          first_id: page.first_id,
          last_id: page.last_id,
          has_more: page.has_more,
        };
      }
      // Follow live: every event after `after`, then new ones as they are written, until the
      // terminal event or the client leaves.
      const sse = new SseWriter(res);
      let after = query.after;
      try {
        while (sse.open) {
          const page = await store.jobs.listEvents(job.entity, job.id, { after, limit: 100 });
          for (const event of page.data) {
            sse.send(eventToWire(event));
            after = event.id;
            if (TERMINAL_EVENT_TYPES.has(event.type)) return RESPONDED;
          }
          if (!page.has_more) await new Promise((resolve) => setTimeout(resolve, pollMs));
        }
      } finally {
        sse.end();
      }
      return RESPONDED;
    },
  };
}
