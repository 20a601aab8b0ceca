import {
  type Clock,
  type Json,
  type JsonInput,
  type Page,
  type PageOptions,
  pageLimit,
  placeholders,
  toJson,
  toPage,
} from "./common.ts";
import { ConflictError, isUniqueViolation, NotFoundError } from "./errors.ts";
import { unixSeconds, uuidv7 } from "./ids.ts";
import {
  json,
  jsonOrEmpty,
  num,
  numOrNull,
  type RowOf,
  rowSchema,
  str,
  strOrNull,
} from "./rows.ts";
import { inList, listParam, presentAmong, type Sql, type SqlValue } from "./sql.ts";

export type JobType = "rl" | "sft";

/** How far a job got: its last gradient step (of `total_steps`) and that step's loss/reward. */
export interface JobProgress {
  step: number;
  total_steps: number | null;
  loss: number | null;
  reward: number | null;
}
export type JobStatus = "queued" | "running" | "succeeded" | "failed" | "cancelled";
export const TERMINAL_STATUSES: readonly JobStatus[] = ["succeeded", "failed", "cancelled"];

/** The `training_jobs` table. */
export const JOBS = rowSchema({
  id: str,
  type: str<JobType>,
  model_id: str,
  entity: str,
  status: str<JobStatus>,
  config: jsonOrEmpty<Json>,
  /** Where the job's input lives (a blob key or a dataset:// URL); the row never holds it. */
  payload_ref: strOrNull,
  created_at: num,
  training_start: numOrNull,
  training_end: numOrNull,
  error_message: strOrNull,
  step_from: numOrNull,
  step_to: numOrNull,
  lease_owner: strOrNull,
  /** Unix milliseconds. */
  lease_expires_at: numOrNull,
  /** Times the job was claimed. */
  attempts: num,
  /** Claims that ended with their worker dead rather than with the job finished or handed back. */
  crashes: num,
  /** Unix seconds when the job was paused (it stays `queued` and is not claimed); null otherwise. */
  paused_at: numOrNull,
});
export interface TrainingJob extends RowOf<typeof JOBS> {}

/** The `job_events` table, less its `step` (`eventStep`'s key). */
const EVENTS = rowSchema({
  id: str,
  job_id: str,
  sequence: num,
  type: str,
  data: jsonOrEmpty<Json>,
  created_at: num,
});
export interface JobEvent extends RowOf<typeof EVENTS> {}

export interface EnqueueInput {
  type: JobType;
  model_id: string;
  entity: string;
  config?: JsonInput;
  payload_ref?: string | null;
  step_from?: number | null;
}

/**
 * The event types that report a step, and the `data` field that names it: `gradient_step` and
 * `validation` (the job's own step count) and `checkpoint_saved` (the model's step). A job has at most one event
 * of each type per step, so a step that a resumed run trains again, or that two workers both
 * reach after a lease expired, is reported once: the first report stands.
 */
const STEP_FIELDS: Readonly<Record<string, string>> = {
  gradient_step: "gradient_step",
  validation: "gradient_step",
  checkpoint_saved: "step",
};

/** The step an event reports, its key among the job's events of its type; null for the others. */
export function eventStep(type: string, data: JsonInput): number | null {
  const field = STEP_FIELDS[type];
  if (field === undefined || data === null || typeof data !== "object" || Array.isArray(data))
    return null;
  const step = (data as { readonly [key: string]: JsonInput })[field];
  return typeof step === "number" && Number.isSafeInteger(step) ? step : null;
}

/** The oldest queued job, not paused, whose model has neither a running job nor an older queued
 * one that is not paused. */
const NEXT_RUNNABLE = `
  SELECT j.id FROM training_jobs j
  WHERE j.status = 'queued' AND j.paused_at IS NULL
    AND NOT EXISTS (SELECT 1 FROM training_jobs r
                    WHERE r.model_id = j.model_id AND r.status = 'running')
    AND NOT EXISTS (SELECT 1 FROM training_jobs e
                    WHERE e.model_id = j.model_id AND e.status = 'queued' AND e.paused_at IS NULL
                      AND e.id < j.id)
  ORDER BY j.id
  LIMIT 1`;
const JOB_ID = JOBS.pick("id");

/** What `progress` reads of a job: the data of its latest `gradient_step` and first
 * `training_started` events, or null. */
const PROGRESS = rowSchema({
  id: str,
  step: json<Record<string, unknown>>,
  started: json<Record<string, unknown>>,
});

/** Jobs counted by status. */
const DEPTH = rowSchema({ status: str<JobStatus>, n: num });

export interface ReclaimResult {
  /** Jobs whose worker died and that are queued again (to be resumed from their last step). */
  requeued: TrainingJob[];
  /** Jobs whose worker died once too often: failed, with a terminal event. */
  failed: TrainingJob[];
}

/**
 * Training jobs, their events, and the work queue. The row is the truth: a job is queued by
 * inserting it, claimed by leasing it, and ends with exactly one terminal event written in the
 * same transaction as its terminal status. A step is reported at most once (`eventStep`).
 */
export class JobsRepo {
  readonly #sql: Sql;
  readonly #now: Clock;
  readonly #maxCrashes: number;
  constructor(sql: Sql, now: Clock, maxCrashes = 2) {
    this.#sql = sql;
    this.#now = now;
    this.#maxCrashes = maxCrashes;
  }

  async enqueue(input: EnqueueInput): Promise<TrainingJob> {
    const now = this.#now();
    const row = await this.#sql.one(
      `INSERT INTO training_jobs (id, type, model_id, entity, status, config, payload_ref, created_at, step_from)
       SELECT $1, $2, m.id, m.entity, 'queued', $5, $6, CAST($7 AS BIGINT), CAST($8 AS INTEGER) FROM models m
       WHERE m.id = $3 AND m.entity = $4
       RETURNING ${JOBS.columns()}`,
      [
        uuidv7(now),
        input.type,
        input.model_id,
        input.entity,
        toJson(input.config ?? {}),
        input.payload_ref ?? null,
        unixSeconds(now),
        input.step_from ?? null,
      ],
    );
    if (!row) throw new NotFoundError(`Model ${input.model_id} not found`);
    return JOBS.read(row);
  }

  async get(entity: string, id: string): Promise<TrainingJob | undefined> {
    const row = await this.#sql.one(
      `SELECT ${JOBS.columns()} FROM training_jobs WHERE entity = $1 AND id = $2`,
      [entity, id],
    );
    return row ? JOBS.read(row) : undefined;
  }

  /** Jobs of the given entities in creation order (ids are UUID v7), oldest first unless
   * `order` is `desc`; `project` is their model's. */
  async list(
    entities: string | readonly string[],
    options: PageOptions & {
      model_id?: string;
      /** `paused`: queued jobs that are paused; `queued`: those that are not. */
      status?: JobStatus | "paused";
      project?: string;
      order?: "asc" | "desc";
    } = {},
  ): Promise<Page<TrainingJob>> {
    const list = typeof entities === "string" ? [entities] : [...entities];
    const limit = pageLimit(options.limit);
    if (list.length === 0) return toPage([], limit);
    const desc = options.order === "desc";
    const rows = await this.#sql.query(
      `SELECT ${JOBS.columns("j")} FROM training_jobs j
       WHERE j.entity IN (${placeholders(list.length, 6)})
         AND (CAST($1 AS TEXT) IS NULL OR j.id ${desc ? "<" : ">"} $1)
         AND (CAST($2 AS TEXT) IS NULL OR j.model_id = $2)
         AND (CAST($3 AS TEXT) IS NULL OR (CASE WHEN j.paused_at IS NULL THEN j.status ELSE 'paused' END) = $3)
         AND (CAST($4 AS TEXT) IS NULL OR EXISTS
              (SELECT 1 FROM models m WHERE m.id = j.model_id AND m.project = $4))
       ORDER BY j.id ${desc ? "DESC" : "ASC"} LIMIT $5`,
      [
        options.after ?? null,
        options.model_id ?? null,
        options.status ?? null,
        options.project ?? null,
        limit + 1,
        ...list,
      ],
    );
    return toPage(rows.map(JOBS.read), limit);
  }

  // ---- queue -----------------------------------------------------------------------------------

  /**
   * Leases the next runnable job to `workerId` for `leaseMs`, or returns undefined. PostgreSQL
   * skips rows other claimers hold (FOR UPDATE SKIP LOCKED); SQLite claims inside an IMMEDIATE
   * transaction, which already excludes every other writer.
   */
  async claimNextJob(workerId: string, leaseMs: number): Promise<TrainingJob | undefined> {
    for (let attempt = 0; attempt < 5; attempt++) {
      const now = this.#now();
      try {
        const job = await this.#sql.transaction(async (tx) => {
          const pick =
            tx.dialect === "postgres"
              ? `${NEXT_RUNNABLE} FOR UPDATE OF j SKIP LOCKED`
              : NEXT_RUNNABLE;
          const next = await tx.one(pick);
          if (!next) return undefined;
          const row = await tx.one(
            `UPDATE training_jobs
             SET status = 'running', lease_owner = $2, lease_expires_at = $3,
                 attempts = attempts + 1, training_start = COALESCE(training_start, $4)
             WHERE id = $1 AND status = 'queued' RETURNING ${JOBS.columns()}`,
            [JOB_ID.read(next).id, workerId, now + leaseMs, unixSeconds(now)],
          );
          return row ? JOBS.read(row) : undefined;
        });
        return job;
      } catch (err) {
        // Two claimers picked different queued jobs of one model at once; the partial unique
        // index refused the second. Look again.
        if (isUniqueViolation(err)) continue;
        throw err;
      }
    }
    return undefined;
  }

  /** Extends the lease; false when the job is no longer running under this worker. */
  async renewLease(workerId: string, jobId: string, leaseMs: number): Promise<boolean> {
    const n = await this.#sql.exec(
      `UPDATE training_jobs SET lease_expires_at = $3
       WHERE id = $1 AND lease_owner = $2 AND status = 'running'`,
      [jobId, workerId, this.#now() + leaseMs],
    );
    return n > 0;
  }

  /**
   * Hands a running job back to the queue (graceful shutdown): it will be claimed again and
   * resumed from its last checkpoint. False when the job is not running under this worker.
   */
  async releaseJob(workerId: string, jobId: string): Promise<boolean> {
    const n = await this.#sql.exec(
      `UPDATE training_jobs SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL
       WHERE id = $1 AND lease_owner = $2 AND status = 'running'`,
      [jobId, workerId],
    );
    return n > 0;
  }

  /**
   * Appends an event; its sequence follows the job's last one. A step event (`eventStep`) for
   * a step the job already reported is ignored: undefined, and the first report stands.
   */
  async appendEvent(
    jobId: string,
    type: string,
    data: JsonInput = {},
  ): Promise<JobEvent | undefined> {
    return this.#sql.transaction((tx) => this.#appendEvent(tx, jobId, type, data));
  }

  async #appendEvent(
    tx: Sql,
    jobId: string,
    type: string,
    data: JsonInput,
  ): Promise<JobEvent | undefined> {
    const now = this.#now();
    if (tx.dialect === "postgres") {
      // Serialises appends per job so two writers never pick the same sequence.
      await tx.query("SELECT id FROM training_jobs WHERE id = $1 FOR UPDATE", [jobId]);
    }
    const row = await tx.one(
      `INSERT INTO job_events (job_id, sequence, id, type, data, created_at, step)
       SELECT $1, COALESCE(MAX(sequence), 0) + 1, $2, $3, $4, CAST($5 AS BIGINT), CAST($6 AS INTEGER)
       FROM job_events WHERE job_id = $1
       ON CONFLICT (job_id, type, step) WHERE step IS NOT NULL DO NOTHING
       RETURNING ${EVENTS.columns()}`,
      [jobId, uuidv7(now), type, toJson(data), unixSeconds(now), eventStep(type, data)],
    );
    return row ? EVENTS.read(row) : undefined;
  }

  /** Whether the job has an event of `type` (e.g. whether a run of it started training). */
  async hasEvent(jobId: string, type: string): Promise<boolean> {
    const row = await this.#sql.one(
      "SELECT 1 AS found FROM job_events WHERE job_id = $1 AND type = $2 LIMIT 1",
      [jobId, type],
    );
    return row !== undefined;
  }

  /** Events in creation order, paged by `after` (an event id). */
  async listEvents(
    entity: string,
    jobId: string,
    options: PageOptions & { order?: "asc" | "desc" } = {},
  ): Promise<Page<JobEvent>> {
    const limit = pageLimit(options.limit);
    const desc = options.order === "desc";
    const rows = await this.#sql.query(
      `SELECT ${EVENTS.columns("e")} FROM job_events e JOIN training_jobs j ON j.id = e.job_id
       WHERE j.entity = $1 AND e.job_id = $2
         AND (CAST($3 AS TEXT) IS NULL OR e.sequence ${desc ? "<" : ">"} (SELECT a.sequence FROM job_events a WHERE a.job_id = $2 AND a.id = $3))
       ORDER BY e.sequence ${desc ? "DESC" : "ASC"} LIMIT $4`,
      [entity, jobId, options.after ?? null, limit + 1],
    );
    return toPage(rows.map(EVENTS.read), limit);
  }

  /** The tokens of the sequences a job's reported steps trained on: the sum of its
   * `gradient_step` events' `num_tokens` (each step is reported once). */
  async trainedTokens(jobId: string): Promise<number> {
    const value =
      this.#sql.dialect === "sqlite"
        ? "CAST(json_extract(data, '$.num_tokens') AS INTEGER)"
        : "CAST(CAST(data AS jsonb)->>'num_tokens' AS BIGINT)";
    const row = await this.#sql.one(
      `SELECT COALESCE(SUM(${value}), 0) AS n FROM job_events
       WHERE job_id = $1 AND type = 'gradient_step'`,
      [jobId],
    );
    return Number(row?.n ?? 0);
  }

  /** Records the step range a running job covers (e.g. step_to once known). */
  async updateProgress(
    workerId: string,
    jobId: string,
    progress: { step_from?: number; step_to?: number },
  ): Promise<boolean> {
    const n = await this.#sql.exec(
      `UPDATE training_jobs SET step_from = COALESCE($3, step_from), step_to = COALESCE($4, step_to)
       WHERE id = $1 AND lease_owner = $2 AND status = 'running'`,
      [jobId, workerId, progress.step_from ?? null, progress.step_to ?? null],
    );
    return n > 0;
  }

  /** running → succeeded, with the `training_ended` event. ConflictError if not leased to worker. */
  async completeJob(
    workerId: string,
    jobId: string,
    result: { step_to?: number } = {},
  ): Promise<TrainingJob> {
    return this.#finish(jobId, "succeeded", "training_ended", {}, null, {
      workerId,
      stepTo: result.step_to ?? null,
    });
  }

  /** running → failed, with `training_failed`. ConflictError if not leased to this worker. */
  async failJob(workerId: string, jobId: string, errorMessage: string): Promise<TrainingJob> {
    return this.#finish(
      jobId,
      "failed",
      "training_failed",
      { error_message: errorMessage },
      errorMessage,
      {
        workerId,
        stepTo: null,
      },
    );
  }

  /**
   * queued|running → cancelled, with `training_failed` ("cancelled"). A job already ended is
   * returned unchanged. The worker notices on its next renewLease (false).
   */
  async cancelJob(entity: string, jobId: string): Promise<TrainingJob> {
    const job = await this.get(entity, jobId);
    if (!job) throw new NotFoundError(`Training job ${jobId} not found`);
    if (TERMINAL_STATUSES.includes(job.status)) return job;
    try {
      return await this.#finish(
        jobId,
        "cancelled",
        "training_failed",
        { error_message: "cancelled" },
        "cancelled",
        {
          entity,
        },
      );
    } catch (err) {
      if (err instanceof ConflictError) {
        const now = await this.get(entity, jobId);
        if (now) return now;
      }
      throw err;
    }
  }

  /**
   * queued|running → paused: the job is `queued` with `paused_at` set, never claimed until
   * `resumeJob`. A running job loses its lease, so its worker stops it (as for a cancel) and its
   * next run resumes from its last checkpoint; the pause counts as no crash. Undefined when the
   * job is not queued or running (or is paused already).
   */
  async pauseJob(entity: string, jobId: string): Promise<TrainingJob | undefined> {
    const row = await this.#sql.one(
      `UPDATE training_jobs
       SET status = 'queued', paused_at = $3, lease_owner = NULL, lease_expires_at = NULL
       WHERE id = $1 AND entity = $2 AND status IN ('queued', 'running') AND paused_at IS NULL
       RETURNING ${JOBS.columns()}`,
      [jobId, entity, unixSeconds(this.#now())],
    );
    return row ? JOBS.read(row) : undefined;
  }

  /** paused → queued again. Undefined when the job is not paused. */
  async resumeJob(entity: string, jobId: string): Promise<TrainingJob | undefined> {
    const row = await this.#sql.one(
      `UPDATE training_jobs SET paused_at = NULL
       WHERE id = $1 AND entity = $2 AND status = 'queued' AND paused_at IS NOT NULL
       RETURNING ${JOBS.columns()}`,
      [jobId, entity],
    );
    return row ? JOBS.read(row) : undefined;
  }

  async #finish(
    jobId: string,
    status: JobStatus,
    eventType: string,
    eventData: Json,
    errorMessage: string | null,
    guard: { workerId?: string; entity?: string; stepTo?: number | null },
  ): Promise<TrainingJob> {
    return this.#sql.transaction(async (tx) => {
      const row = await tx.one(
        `UPDATE training_jobs
         SET status = $2, training_end = $3, error_message = COALESCE($4, error_message),
             step_to = COALESCE($5, step_to), lease_owner = NULL, lease_expires_at = NULL,
             paused_at = NULL
         WHERE id = $1 AND status IN ('queued', 'running')
           AND (CAST($6 AS TEXT) IS NULL OR (lease_owner = $6 AND status = 'running'))
           AND (CAST($7 AS TEXT) IS NULL OR entity = $7)
         RETURNING ${JOBS.columns()}`,
        [
          jobId,
          status,
          unixSeconds(this.#now()),
          errorMessage,
          guard.stepTo ?? null,
          guard.workerId ?? null,
          guard.entity ?? null,
        ],
      );
      if (!row) throw new ConflictError(`Training job ${jobId} is not running under this worker`);
      await this.#appendEvent(tx, jobId, eventType, eventData);
      return JOBS.read(row);
    });
  }

  /**
   * Running jobs whose lease expired (their worker died): queued again while they have crashed
   * fewer than the allowed times, else failed with a terminal event. Call it on start and
   * periodically.
   */
  async reclaimExpiredLeases(): Promise<ReclaimResult> {
    return this.#reclaim(
      "lease_expires_at < $1",
      [this.#now()],
      "its worker stopped renewing its lease",
    );
  }

  /**
   * Running jobs leased by an earlier run of this worker: its identity (`ownerPrefix`, stable
   * across restarts) with another boot than `currentOwner`. They are reclaimed at once rather
   * than after their lease, as crashed.
   */
  async reclaimOwnLeases(ownerPrefix: string, currentOwner: string): Promise<ReclaimResult> {
    return this.#reclaim(
      "substr(lease_owner, 1, $1) = $2 AND lease_owner <> $3",
      [ownerPrefix.length, ownerPrefix, currentOwner],
      "its worker restarted",
    );
  }

  async #reclaim(where: string, params: SqlValue[], why: string): Promise<ReclaimResult> {
    const now = this.#now();
    return this.#sql.transaction(async (tx) => {
      const lock = tx.dialect === "postgres" ? " FOR UPDATE SKIP LOCKED" : "";
      const crashed = await tx.query(
        `SELECT ${JOBS.columns()} FROM training_jobs WHERE status = 'running' AND ${where} ORDER BY id${lock}`,
        params,
      );
      const result: ReclaimResult = { requeued: [], failed: [] };
      for (const r of crashed) {
        const job = JOBS.read(r);
        const crashes = job.crashes + 1;
        if (crashes < this.#maxCrashes) {
          const row = await tx.one(
            `UPDATE training_jobs SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL,
               crashes = $2
             WHERE id = $1 RETURNING ${JOBS.columns()}`,
            [job.id, crashes],
          );
          result.requeued.push(JOBS.read(row!));
        } else {
          const message = `The training worker died while running this job ${crashes} times (last: ${why}); the job is not retried again.`;
          const row = await tx.one(
            `UPDATE training_jobs SET status = 'failed', training_end = $2, error_message = $3,
               lease_owner = NULL, lease_expires_at = NULL, crashes = $4
             WHERE id = $1 RETURNING ${JOBS.columns()}`,
            [job.id, unixSeconds(now), message, crashes],
          );
          await this.#appendEvent(tx, job.id, "training_failed", { error_message: message });
          result.failed.push(JOBS.read(row!));
        }
      }
      return result;
    });
  }

  /** Each job's progress (jobs with no gradient step yet have none), from its latest
   * `gradient_step` and first `training_started` events: one query for all of them. */
  async progress(jobIds: readonly string[]): Promise<Map<string, JobProgress>> {
    const out = new Map<string, JobProgress>();
    const ids = [...new Set(jobIds)];
    if (ids.length === 0) return out;
    const finite = (v: unknown) => (typeof v === "number" && Number.isFinite(v) ? v : null);
    // Per job, on the (job_id, sequence) key: the last gradient_step walking back from the end
    // (it is the latest event or nearly), and training_started walking from the start (it is
    // the first), so a long job's thousands of step events are never read.
    const one = (type: string, order: "ASC" | "DESC") =>
      `(SELECT data FROM job_events WHERE job_id = ids.value AND type = '${type}'
        ORDER BY sequence ${order} LIMIT 1)`;
    const list =
      this.#sql.dialect === "sqlite"
        ? "json_each($1) AS ids"
        : "jsonb_array_elements_text($1::jsonb) AS ids(value)";
    const rows = await this.#sql.query(
      `SELECT ids.value AS id, ${one("gradient_step", "DESC")} AS step,
              ${one("training_started", "ASC")} AS started
       FROM ${list}`,
      [listParam(ids)],
    );
    for (const { id, step, started } of rows.map(PROGRESS.read)) {
      if (step === null) continue;
      out.set(id, {
        step: finite(step.gradient_step) ?? 0,
        total_steps: started === null ? null : finite(started.num_sequences),
        loss: finite(step.loss),
        reward: finite(step.reward),
      });
    }
    return out;
  }

  /** Whether `workerId` still holds job `jobId`: running, under its lease. A read, unlike
   * `renewLease`, for a supervisor that watches for cancels made by other processes. */
  async stillHeld(workerId: string, jobId: string): Promise<boolean> {
    const row = await this.#sql.one(
      `SELECT 1 AS held FROM training_jobs
       WHERE id = $1 AND lease_owner = $2 AND status = 'running'`,
      [jobId, workerId],
    );
    return row !== undefined;
  }

  /** Of these model ids, the ones with a running job (whose worker may be writing files). */
  runningAmong(modelIds: readonly string[]): Promise<Set<string>> {
    return presentAmong(
      this.#sql,
      `SELECT model_id AS value FROM training_jobs
       WHERE status = 'running' AND ${inList(this.#sql.dialect, "model_id", 1)}`,
      modelIds,
    );
  }

  /** A job, not ended, whose input is `payloadRef` (a `dataset://` URL); undefined if none. */
  async unfinishedReading(payloadRef: string): Promise<string | undefined> {
    const row = await this.#sql.one(
      `SELECT id FROM training_jobs WHERE payload_ref = $1 AND status IN ('queued', 'running')
       ORDER BY id LIMIT 1`,
      [payloadRef],
    );
    return row ? String(row.id) : undefined;
  }

  /** Of these blob keys, the ones a job names as its input. */
  referencedPayloads(keys: readonly string[]): Promise<Set<string>> {
    return presentAmong(
      this.#sql,
      `SELECT payload_ref AS value FROM training_jobs WHERE ${inList(this.#sql.dialect, "payload_ref", 1)}`,
      keys,
    );
  }

  /** Counts by status, for metrics and the system check. */
  async depth(): Promise<Record<JobStatus, number>> {
    const rows = await this.#sql.query(
      "SELECT status, COUNT(*) AS n FROM training_jobs GROUP BY status",
    );
    const out: Record<JobStatus, number> = {
      queued: 0,
      running: 0,
      succeeded: 0,
      failed: 0,
      cancelled: 0,
    };
    for (const { status, n } of rows.map(DEPTH.read)) out[status] = n;
    return out;
  }
}
