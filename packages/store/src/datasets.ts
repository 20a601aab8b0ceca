import {
  type Clock,
  type Page,
  type PageOptions,
  pageLimit,
  placeholders,
  toPage,
} from "./common.ts";
import { unixSeconds, uuidv7 } from "./ids.ts";
import { num, type RowOf, rowSchema, str, strOrNull } from "./rows.ts";
import { inList, presentAmong, type Sql } from "./sql.ts";

/** The `datasets` table. */
const DATASETS = rowSchema({
  id: str,
  entity: str,
  name: strOrNull,
  /** The file name it was uploaded under through OpenAI's files API (ADR 70); null otherwise. */
  filename: strOrNull,
  blob_key: str,
  bytes: num,
  lines: num,
  created_at: num,
});
export interface Dataset extends RowOf<typeof DATASETS> {}

/** Uploaded JSONL training data. The blob is written (atomically) before the row. */
export class DatasetsRepo {
  readonly #sql: Sql;
  readonly #now: Clock;
  constructor(sql: Sql, now: Clock) {
    this.#sql = sql;
    this.#now = now;
  }

  /** A fresh id, so the caller can name the blob before the row exists. */
  newId(): string {
    return uuidv7(this.#now());
  }

  async create(input: {
    id?: string;
    entity: string;
    name?: string | null;
    filename?: string | null;
    blob_key: string;
    bytes: number;
    lines: number;
  }): Promise<Dataset> {
    const now = this.#now();
    const row = await this.#sql.one(
      `INSERT INTO datasets (id, entity, name, blob_key, bytes, lines, created_at, filename)
       VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING ${DATASETS.columns()}`,
      [
        input.id ?? uuidv7(now),
        input.entity,
        input.name ?? null,
        input.blob_key,
        input.bytes,
        input.lines,
        unixSeconds(now),
        input.filename ?? null,
      ],
    );
    return DATASETS.read(row!);
  }

  async get(entity: string, id: string): Promise<Dataset | undefined> {
    const row = await this.#sql.one(
      `SELECT ${DATASETS.columns()} FROM datasets WHERE entity = $1 AND id = $2`,
      [entity, id],
    );
    return row ? DATASETS.read(row) : undefined;
  }

  /** The datasets of these entities, by id (oldest first, or newest with `order: "desc"`);
   * only those uploaded under `name` when given. */
  async list(
    entities: string | readonly string[],
    options: PageOptions & { name?: string; order?: "asc" | "desc" } = {},
  ): Promise<Page<Dataset>> {
    const list = typeof entities === "string" ? [entities] : [...entities];
    const limit = pageLimit(options.limit);
    if (list.length === 0) return toPage([], limit);
    const desc = options.order === "desc";
    const rows = await this.#sql.query(
      `SELECT ${DATASETS.columns()} FROM datasets
       WHERE entity IN (${placeholders(list.length, 4)})
         AND (CAST($1 AS TEXT) IS NULL OR id ${desc ? "<" : ">"} $1)
         AND (CAST($2 AS TEXT) IS NULL OR name = $2)
       ORDER BY id ${desc ? "DESC" : "ASC"} LIMIT $3`,
      [options.after ?? null, options.name ?? null, limit + 1, ...list],
    );
    return toPage(rows.map(DATASETS.read), limit);
  }

  /** Of these blob keys, the ones a dataset names. */
  referencedBlobKeys(keys: readonly string[]): Promise<Set<string>> {
    return presentAmong(
      this.#sql,
      `SELECT blob_key AS value FROM datasets WHERE ${inList(this.#sql.dialect, "blob_key", 1)}`,
      keys,
    );
  }

  /** Deletes the row and returns it, so the caller can remove the blob afterwards. */
  async delete(entity: string, id: string): Promise<Dataset | undefined> {
    const row = await this.#sql.one(
      `DELETE FROM datasets WHERE entity = $1 AND id = $2 RETURNING ${DATASETS.columns()}`,
      [entity, id],
    );
    return row ? DATASETS.read(row) : undefined;
  }
}
