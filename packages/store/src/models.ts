import {
  type Clock,
  type Page,
  type PageOptions,
  pageLimit,
  placeholders,
  toJson,
  toPage,
} from "./common.ts";
import { assertName, ConflictError, NotFoundError } from "./errors.ts";
import { unixSeconds, uuidv7 } from "./ids.ts";
import { JOBS } from "./jobs.ts";
import { jsonOrEmpty, num, numOrNull, type RowOf, rowSchema, str, strOrNull } from "./rows.ts";
import { inList, listParam, presentAmong, type Row, type Sql } from "./sql.ts";

/** The `models` table. */
const MODELS = rowSchema({
  id: str,
  entity: str,
  project: str,
  name: str,
  base_model: str,
  created_at: num,
  latest_step: numOrNull,
});
export interface Model extends RowOf<typeof MODELS> {}

/** The `checkpoints` table. */
const CHECKPOINTS = rowSchema({
  id: str,
  model_id: str,
  step: num,
  metrics: jsonOrEmpty<Record<string, number>>,
  blob_key: strOrNull,
  created_at: num,
});
export interface Checkpoint extends RowOf<typeof CHECKPOINTS> {}

/** A checkpoint's step and the prefix of its files (null for the untrained step 0). */
const CHECKPOINT_FILES = CHECKPOINTS.pick("step", "blob_key");
/** A job's input, which goes with its model. */
const JOB_PAYLOAD = JOBS.pick("payload_ref");
/** A model's latest step, which deleting checkpoints must leave. */
const MODEL_LATEST = MODELS.pick("latest_step");

/** The file prefixes of checkpoint rows (`CHECKPOINT_FILES`) that have files. */
function blobKeys(rows: readonly Row[]): string[] {
  return rows.flatMap((r) => CHECKPOINT_FILES.read(r).blob_key || []);
}

export interface CreateModelInput {
  entity: string;
  project: string;
  name: string;
  base_model: string;
  /** Written in the same transaction, e.g. the step-0 untrained adapter. */
  initialCheckpoint?: { step?: number; blob_key?: string | null; metrics?: Record<string, number> };
}

export class ModelsRepo {
  readonly #sql: Sql;
  readonly #now: Clock;
  constructor(sql: Sql, now: Clock) {
    this.#sql = sql;
    this.#now = now;
  }

  /**
   * Creates a model (and its initial checkpoint when given). A duplicate (entity, project, name)
   * → ConflictError, unless `returnExisting`, which returns the existing model instead.
   */
  async create(
    input: CreateModelInput,
    options: { returnExisting?: boolean } = {},
  ): Promise<{ model: Model; created: boolean }> {
    assertName(input.project, "A project name");
    assertName(input.name, "A model name");
    const now = this.#now();
    const result = await this.#sql.transaction(async (tx) => {
      const row = await tx.one(
        `INSERT INTO models (${MODELS.columns()}) VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (entity, project, name) DO NOTHING RETURNING ${MODELS.columns()}`,
        [
          uuidv7(now),
          input.entity,
          input.project,
          input.name,
          input.base_model,
          unixSeconds(now),
          input.initialCheckpoint ? (input.initialCheckpoint.step ?? 0) : null,
        ],
      );
      if (!row) return undefined;
      const model = MODELS.read(row);
      if (input.initialCheckpoint) {
        await tx.exec(
          `INSERT INTO checkpoints (id, model_id, step, metrics, blob_key, created_at)
           VALUES ($1, $2, $3, $4, $5, $6)`,
          [
            uuidv7(now),
            model.id,
            input.initialCheckpoint.step ?? 0,
            toJson(input.initialCheckpoint.metrics ?? {}),
            input.initialCheckpoint.blob_key ?? null,
            unixSeconds(now),
          ],
        );
      }
      return model;
    });
    if (result) return { model: result, created: true };
    const existing = await this.getByName(input.entity, input.project, input.name);
    if (options.returnExisting && existing) return { model: existing, created: false };
    throw new ConflictError(`Model ${input.entity}/${input.project}/${input.name} already exists`);
  }

  async get(entity: string, id: string): Promise<Model | undefined> {
    const row = await this.#sql.one(
      `SELECT ${MODELS.columns()} FROM models WHERE entity = $1 AND id = $2`,
      [entity, id],
    );
    return row ? MODELS.read(row) : undefined;
  }

  async getByName(entity: string, project: string, name: string): Promise<Model | undefined> {
    const row = await this.#sql.one(
      `SELECT ${MODELS.columns()} FROM models WHERE entity = $1 AND project = $2 AND name = $3`,
      [entity, project, name],
    );
    return row ? MODELS.read(row) : undefined;
  }

  /** Every model of the entity named `name`, whatever its project (an ambiguous name's 409
   * lists them all). */
  async findByName(entity: string, name: string): Promise<Model[]> {
    const rows = await this.#sql.query(
      `SELECT ${MODELS.columns()} FROM models WHERE entity = $1 AND name = $2 ORDER BY id`,
      [entity, name],
    );
    return rows.map(MODELS.read);
  }

  /** Models of the given entities (e.g. every entity a key may use), for model listings, in
   * creation order (ids are UUID v7), oldest first unless `order` is `desc`. */
  async list(
    entities: string | readonly string[],
    options: PageOptions & { project?: string; order?: "asc" | "desc" } = {},
  ): Promise<Page<Model>> {
    const list = typeof entities === "string" ? [entities] : [...entities];
    const limit = pageLimit(options.limit);
    if (list.length === 0) return toPage([], limit);
    const desc = options.order === "desc";
    const rows = await this.#sql.query(
      `SELECT ${MODELS.columns()} FROM models
       WHERE entity IN (${placeholders(list.length, 4)})
         AND (CAST($1 AS TEXT) IS NULL OR id ${desc ? "<" : ">"} $1)
         AND (CAST($2 AS TEXT) IS NULL OR project = $2)
       ORDER BY id ${desc ? "DESC" : "ASC"} LIMIT $3`,
      [options.after ?? null, options.project ?? null, limit + 1, ...list],
    );
    return toPage(rows.map(MODELS.read), limit);
  }

  /**
   * Deletes the model, its checkpoints, jobs and events; returns the checkpoints removed and the
   * blob keys its jobs held their input in (RL trajectory groups), for the caller to remove.
   */
  async delete(
    entity: string,
    id: string,
  ): Promise<{
    model: Model;
    deleted_checkpoints: number;
    blob_keys: string[];
    payload_keys: string[];
  }> {
    return this.#sql.transaction(async (tx) => {
      // FOR UPDATE: of concurrent deletes, one finds the row and the others wait, then see it gone.
      const lock = tx.dialect === "postgres" ? " FOR UPDATE" : "";
      const row = await tx.one(
        `SELECT ${MODELS.columns()} FROM models WHERE entity = $1 AND id = $2${lock}`,
        [entity, id],
      );
      if (!row) throw new NotFoundError(`Model ${id} not found`);
      const files = await tx.query(
        `SELECT ${CHECKPOINT_FILES.columns()} FROM checkpoints WHERE model_id = $1`,
        [id],
      );
      const payloads = await tx.query(
        `SELECT ${JOB_PAYLOAD.columns()} FROM training_jobs WHERE model_id = $1`,
        [id],
      );
      await tx.exec("DELETE FROM checkpoints WHERE model_id = $1", [id]);
      await tx.exec("DELETE FROM models WHERE entity = $1 AND id = $2", [entity, id]);
      return {
        model: MODELS.read(row),
        deleted_checkpoints: files.length,
        blob_keys: blobKeys(files),
        // A URL (dataset://, https://) is not ours to delete; a bare key is the job's own blob.
        payload_keys: payloads.flatMap((p) => {
          const ref = JOB_PAYLOAD.read(p).payload_ref;
          return ref && !ref.includes("://") ? [ref] : [];
        }),
      };
    });
  }

  /** Of these ids, the models that exist (any entity): for sweeping their files. */
  existingIds(ids: readonly string[]): Promise<Set<string>> {
    return presentAmong(
      this.#sql,
      `SELECT id AS value FROM models WHERE ${inList(this.#sql.dialect, "id", 1)}`,
      ids,
    );
  }

  /** Of these blob keys, the ones a checkpoint names. */
  referencedBlobKeys(keys: readonly string[]): Promise<Set<string>> {
    return presentAmong(
      this.#sql,
      `SELECT blob_key AS value FROM checkpoints WHERE ${inList(this.#sql.dialect, "blob_key", 1)}`,
      keys,
    );
  }

  // ---- checkpoints -------------------------------------------------------------------------

  /**
   * Adds a checkpoint and raises the model's latest_step to it. A repeated step → ConflictError.
   * The caller writes the blob first (atomically), then this row.
   */
  async addCheckpoint(
    entity: string,
    modelId: string,
    input: { step: number; blob_key?: string | null; metrics?: Record<string, number> },
  ): Promise<Checkpoint> {
    return this.#sql.transaction((tx) => this.#addCheckpoint(tx, entity, modelId, input));
  }

  async #addCheckpoint(
    tx: Sql,
    entity: string,
    modelId: string,
    input: { step: number; blob_key?: string | null; metrics?: Record<string, number> },
    replace = false,
  ): Promise<Checkpoint> {
    const now = this.#now();
    // The lock its latest_step update takes, taken first: a delete of the model (FOR UPDATE)
    // in progress is waited for, and then the model is not found, rather than the insert
    // failing on its foreign key; concurrent adds queue instead of deadlocking on the update.
    const lock = tx.dialect === "postgres" ? " FOR NO KEY UPDATE" : "";
    const model = await tx.one(`SELECT id FROM models WHERE entity = $1 AND id = $2${lock}`, [
      entity,
      modelId,
    ]);
    if (!model) throw new NotFoundError(`Model ${modelId} not found`);
    if (replace)
      await tx.exec("DELETE FROM checkpoints WHERE model_id = $1 AND step = $2", [
        modelId,
        input.step,
      ]);
    const row = await tx.one(
      `INSERT INTO checkpoints (id, model_id, step, metrics, blob_key, created_at)
       VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (model_id, step) DO NOTHING RETURNING ${CHECKPOINTS.columns()}`,
      [
        uuidv7(now),
        modelId,
        input.step,
        toJson(input.metrics ?? {}),
        input.blob_key ?? null,
        unixSeconds(now),
      ],
    );
    if (!row) throw new ConflictError(`Checkpoint step ${input.step} already exists`);
    await tx.exec(
      `UPDATE models SET latest_step = $2 WHERE id = $1 AND (latest_step IS NULL OR latest_step < $2)`,
      [modelId, input.step],
    );
    return CHECKPOINTS.read(row);
  }

  /**
   * Writes checkpoint `step` of a model, replacing the row a step already had (the newest
   * publication of a step wins, ADR 57), and raises latest_step to it. The replaced row's files,
   * which no row names any more, are left to the blob sweep.
   */
  async putCheckpoint(
    entity: string,
    modelId: string,
    input: { step: number; blob_key: string; metrics?: Record<string, number> },
  ): Promise<Checkpoint> {
    return this.#sql.transaction((tx) => this.#addCheckpoint(tx, entity, modelId, input, true));
  }

  async getCheckpoint(
    entity: string,
    modelId: string,
    step?: number,
  ): Promise<Checkpoint | undefined> {
    const row = await this.#sql.one(
      `SELECT ${CHECKPOINTS.columns("c")} FROM checkpoints c JOIN models m ON m.id = c.model_id
       WHERE m.entity = $1 AND c.model_id = $2 AND c.step = COALESCE($3, m.latest_step)`,
      [entity, modelId, step ?? null],
    );
    return row ? CHECKPOINTS.read(row) : undefined;
  }

  /** Pages by step; `after` is the id of the last checkpoint seen. */
  async listCheckpoints(
    entity: string,
    modelId: string,
    options: PageOptions & { order?: "asc" | "desc" } = {},
  ): Promise<Page<Checkpoint>> {
    const limit = pageLimit(options.limit);
    const desc = options.order === "desc";
    const rows = await this.#sql.query(
      `SELECT ${CHECKPOINTS.columns("c")} FROM checkpoints c JOIN models m ON m.id = c.model_id
       WHERE m.entity = $1 AND c.model_id = $2
         AND (CAST($3 AS TEXT) IS NULL OR c.step ${desc ? "<" : ">"}
              (SELECT a.step FROM checkpoints a WHERE a.model_id = $2 AND a.id = $3))
       ORDER BY c.step ${desc ? "DESC" : "ASC"} LIMIT $4`,
      [entity, modelId, options.after ?? null, limit + 1],
    );
    return toPage(rows.map(CHECKPOINTS.read), limit);
  }

  /** Merges metrics into a checkpoint (the log endpoint writes `<split>/<metric>` here). */
  async mergeCheckpointMetrics(
    entity: string,
    modelId: string,
    step: number,
    metrics: Record<string, number>,
  ): Promise<Checkpoint> {
    return this.#sql.transaction(async (tx) => {
      const row = await tx.one(
        `SELECT ${CHECKPOINTS.columns("c")} FROM checkpoints c JOIN models m ON m.id = c.model_id
         WHERE m.entity = $1 AND c.model_id = $2 AND c.step = $3`,
        [entity, modelId, step],
      );
      if (!row) throw new NotFoundError(`Checkpoint step ${step} not found`);
      const checkpoint = CHECKPOINTS.read(row);
      const merged = { ...checkpoint.metrics, ...metrics };
      await tx.exec("UPDATE checkpoints SET metrics = $2 WHERE id = $1", [
        checkpoint.id,
        toJson(merged),
      ]);
      return { ...checkpoint, metrics: merged };
    });
  }

  /**
   * Deletes the given steps. Deleting the latest checkpoint is refused (ConflictError) since it is
   * what the bare model name serves.
   */
  async deleteCheckpoints(
    entity: string,
    modelId: string,
    steps: readonly number[],
  ): Promise<{ deleted_count: number; not_found_steps: number[]; blob_keys: string[] }> {
    return this.#sql.transaction(async (tx) => {
      // FOR UPDATE: a checkpoint being added is waited for, so the latest step read here is the
      // latest when the steps are deleted.
      const lock = tx.dialect === "postgres" ? " FOR UPDATE" : "";
      const row = await tx.one(
        `SELECT ${MODEL_LATEST.columns()} FROM models WHERE entity = $1 AND id = $2${lock}`,
        [entity, modelId],
      );
      if (!row) throw new NotFoundError(`Model ${modelId} not found`);
      const unique = [...new Set(steps)];
      if (unique.length === 0) return { deleted_count: 0, not_found_steps: [], blob_keys: [] };
      const latest = MODEL_LATEST.read(row).latest_step;
      if (latest !== null && unique.includes(latest)) {
        throw new ConflictError(`Checkpoint step ${latest} is the latest and cannot be deleted`);
      }
      // The steps go as one JSON parameter: no list length meets a bound-parameter limit.
      const stepIn = inList(tx.dialect, "step", 2, "integer");
      const found = await tx.query(
        `SELECT ${CHECKPOINT_FILES.columns()} FROM checkpoints WHERE model_id = $1 AND ${stepIn}`,
        [modelId, listParam(unique)],
      );
      await tx.exec(`DELETE FROM checkpoints WHERE model_id = $1 AND ${stepIn}`, [
        modelId,
        listParam(unique),
      ]);
      const foundSteps = new Set(found.map((f) => CHECKPOINT_FILES.read(f).step));
      return {
        deleted_count: found.length,
        not_found_steps: unique.filter((s) => !foundSteps.has(s)).sort((a, b) => a - b),
        blob_keys: blobKeys(found),
      };
    });
  }
}
