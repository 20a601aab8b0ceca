import {
  type Clock,
  type Json,
  type Page,
  type PageOptions,
  pageLimit,
  toJson,
  toPage,
} from "./common.ts";
import { unixSeconds } from "./ids.ts";
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
import type { Sql, SqlValue } from "./sql.ts";

/** The `fine_tuning_jobs` table: what OpenAI's fine-tuning API adds to a training job (ADR 70). */
const FINE_TUNING_JOBS = rowSchema({
  id: str,
  /** The training job that runs it. */
  job_id: str,
  entity: str,
  /** `ft:<base>:<entity>:<suffix>:<short id>`, unique. */
  fine_tuned_model: str,
  /** The `model` the job was created with (a base id, or a fine-tuned model's). */
  base_model: str,
  training_file: str,
  validation_file: strOrNull,
  suffix: strOrNull,
  seed: num,
  method: jsonOrEmpty<Json>,
  hyperparameters: jsonOrEmpty<Json>,
  metadata: json<Record<string, string>>,
  /** Summed once the job has succeeded. */
  trained_tokens: numOrNull,
  created_at: num,
});
export interface FineTuningJob extends RowOf<typeof FINE_TUNING_JOBS> {}

export interface CreateFineTuningJob {
  id: string;
  job_id: string;
  entity: string;
  fine_tuned_model: string;
  base_model: string;
  training_file: string;
  validation_file: string | null;
  suffix: string | null;
  seed: number;
  method: Json;
  hyperparameters: Json;
  metadata: Record<string, string> | null;
}

/** OpenAI's fine-tuning jobs, each beside the training job that runs it. */
export class FineTuningJobsRepo {
  readonly #sql: Sql;
  readonly #now: Clock;
  constructor(sql: Sql, now: Clock) {
    this.#sql = sql;
    this.#now = now;
  }

  async create(input: CreateFineTuningJob): Promise<FineTuningJob> {
    const row = await this.#sql.one(
      `INSERT INTO fine_tuning_jobs (id, job_id, entity, fine_tuned_model, base_model, training_file,
         validation_file, suffix, seed, method, hyperparameters, metadata, created_at)
       VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
       RETURNING ${FINE_TUNING_JOBS.columns()}`,
      [
        input.id,
        input.job_id,
        input.entity,
        input.fine_tuned_model,
        input.base_model,
        input.training_file,
        input.validation_file,
        input.suffix,
        input.seed,
        toJson(input.method),
        toJson(input.hyperparameters),
        input.metadata === null ? null : toJson(input.metadata),
        unixSeconds(this.#now()),
      ],
    );
    return FINE_TUNING_JOBS.read(row!);
  }

  async get(entities: readonly string[], id: string): Promise<FineTuningJob | undefined> {
    if (entities.length === 0) return undefined;
    const row = await this.#sql.one(
      `SELECT ${FINE_TUNING_JOBS.columns()} FROM fine_tuning_jobs
       WHERE id = $1 AND entity IN (${entities.map((_, i) => `$${i + 2}`).join(", ")})`,
      [id, ...entities],
    );
    return row ? FINE_TUNING_JOBS.read(row) : undefined;
  }

  /** The job whose `fine_tuned_model` this is, among these entities'. */
  async byFineTunedModel(
    entities: readonly string[],
    fineTunedModel: string,
  ): Promise<FineTuningJob | undefined> {
    if (entities.length === 0) return undefined;
    const row = await this.#sql.one(
      `SELECT ${FINE_TUNING_JOBS.columns()} FROM fine_tuning_jobs
       WHERE fine_tuned_model = $1 AND entity IN (${entities.map((_, i) => `$${i + 2}`).join(", ")})`,
      [fineTunedModel, ...entities],
    );
    return row ? FINE_TUNING_JOBS.read(row) : undefined;
  }

  /** Newest first, by id (ids follow the training job's UUID v7, so creation order). */
  async list(
    entities: readonly string[],
    options: PageOptions & { metadata?: Record<string, string> | null } = {},
  ): Promise<Page<FineTuningJob>> {
    const limit = pageLimit(options.limit);
    if (entities.length === 0) return toPage([], limit);
    const params: SqlValue[] = [options.after ?? null, limit + 1];
    const where = [`entity IN (${entities.map((e) => `$${params.push(e)}`).join(", ")})`];
    where.push("(CAST($1 AS TEXT) IS NULL OR id < $1)");
    if (options.metadata === null) where.push("metadata IS NULL");
    // Metadata is at most 16 pairs, so its filter is applied to the page's rows as they are
    // read, a page at a time, rather than through each dialect's JSON operators.
    const wanted = options.metadata ? Object.entries(options.metadata) : [];
    const out: FineTuningJob[] = [];
    let after = options.after ?? null;
    for (;;) {
      params[0] = after;
      const rows = (
        await this.#sql.query(
          `SELECT ${FINE_TUNING_JOBS.columns()} FROM fine_tuning_jobs WHERE ${where.join(" AND ")}
           ORDER BY id DESC LIMIT $2`,
          params,
        )
      ).map(FINE_TUNING_JOBS.read);
      for (const job of rows) {
        if (wanted.every(([k, v]) => job.metadata?.[k] === v)) out.push(job);
        if (out.length > limit) return toPage(out, limit);
      }
      if (rows.length < limit + 1) return toPage(out, limit);
      after = rows.at(-1)!.id;
    }
  }

  /** Records the trained tokens of a job that has succeeded. */
  async setTrainedTokens(id: string, tokens: number): Promise<void> {
    await this.#sql.exec("UPDATE fine_tuning_jobs SET trained_tokens = $2 WHERE id = $1", [
      id,
      tokens,
    ]);
  }

  /** The jobs, not yet ended, that read one of these file ids. */
  async readingFile(entity: string, fileId: string): Promise<FineTuningJob | undefined> {
    const row = await this.#sql.one(
      `SELECT ${FINE_TUNING_JOBS.columns("f")} FROM fine_tuning_jobs f
       JOIN training_jobs j ON j.id = f.job_id
       WHERE f.entity = $1 AND (f.training_file = $2 OR f.validation_file = $2)
         AND j.status IN ('queued', 'running')
       ORDER BY f.id LIMIT 1`,
      [entity, fileId],
    );
    return row ? FINE_TUNING_JOBS.read(row) : undefined;
  }
}
