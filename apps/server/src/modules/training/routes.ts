import { ConflictError, type Store, TERMINAL_STATUSES } from "@arbor/store";
import { enqueueRlJob, enqueueSftJob } from "@arbor/training";
import { type Handlers, RESPONDED } from "../../http/operations.ts";
import { disconnectSignal, SseWriter } from "../../http/sse.ts";
import { findModel } from "../models/service.ts";
import { eventToWire, findJob, followEvents, jobToWire } from "./service.ts";

export interface TrainingDeps {
  store: Store;
  /** How often a live follower looks for new events. */
  followPollMs?: number;
  onJobQueued?: () => void;
  /** Told when a job was cancelled here, so a worker in this process stops it mid-step. */
  onJobCancelled?: (jobId: string) => void;
}

/** Training jobs and their events (the spec's `training-jobs` operations). */
export function trainingHandlers(deps: TrainingDeps): Handlers {
  const { store } = deps;
  const pollMs = deps.followPollMs ?? 200;
  const queued = (job: Parameters<typeof jobToWire>[0]) => {
    deps.onJobQueued?.();
    return jobToWire(job);
  };
  return {
    createRlTrainingJob: async ({ body, principal }) =>
      queued(await enqueueRlJob(store, await findModel(store, principal, body.model_id), body)),
    createSftTrainingJob: async ({ body, principal }) =>
      queued(await enqueueSftJob(store, await findModel(store, principal, body.model_id), body)),
    listTrainingJobs: async ({ query, principal }) => {
      const page = await store.jobs.list(principal.entities, {
        after: query.after,
        limit: query.limit ?? 20,
        model_id: query.model_id,
        status: query.status,
        project: query.project,
        order: "desc",
      });
      const progress = await store.jobs.progress(page.data.map((j) => j.id));
      return {
        object: "list",
        ...page,
        data: page.data.map((j) => jobToWire(j, progress.get(j.id) ?? null)),
      };
    },
    retrieveTrainingJob: async ({ params, principal }) => {
      const job = await findJob(store, principal, params.training_job_id);
      return jobToWire(job, (await store.jobs.progress([job.id])).get(job.id) ?? null);
    },

    cancelTrainingJob: async ({ params, principal }) => {
      const job = await findJob(store, principal, params.training_job_id);
      if (TERMINAL_STATUSES.includes(job.status)) {
        throw new ConflictError(`Training job ${job.id} already ended (${job.status}).`, {
          code: "job_already_ended",
        });
      }
      const cancelled = await store.jobs.cancelJob(job.entity, job.id);
      deps.onJobCancelled?.(job.id);
      return jobToWire(cancelled, (await store.jobs.progress([job.id])).get(job.id) ?? null);
    },

    listTrainingJobEvents: async ({ params, query, principal, req, res }) => {
      const job = await findJob(store, principal, params.training_job_id);
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
      // Follow live until the terminal event or the client leaves.
      const sse = new SseWriter(res);
      const signal = disconnectSignal(res);
      try {
        for await (const event of followEvents(store, job, { after: query.after, pollMs, signal }))
          sse.send(event);
      } finally {
        sse.end();
      }
      return RESPONDED;
    },
  };
}
