import type { Clock } from "./common.ts";
import { NotFoundError } from "./errors.ts";
import { uuidv7 } from "./ids.ts";
import { num, numOrNull, type RowOf, rowSchema, str, strOrNull } from "./rows.ts";
import type { Sql } from "./sql.ts";

/** The `prices` table, less its `created_at`. */
const PRICES = rowSchema({
  id: str,
  model: str,
  /** null for the default price of a model; a project's own price overrides it. */
  project_id: strOrNull,
  /** Cost per token. */
  prompt_token_cost: num,
  completion_token_cost: num,
  cache_read_input_token_cost: numOrNull,
  cache_creation_input_token_cost: numOrNull,
  /** ISO 8601 (UTC). A call is priced with the newest price whose date is <= its start. */
  effective_date: str,
});
export interface Price extends RowOf<typeof PRICES> {}
/** The price a set replaces, found by its key. */
const PRICE_ID = PRICES.pick("id");

export interface SetPriceInput {
  model: string;
  project_id?: string | null;
  prompt_token_cost: number;
  completion_token_cost: number;
  cache_read_input_token_cost?: number | null;
  cache_creation_input_token_cost?: number | null;
  effective_date: string | Date;
}

/** Normalises any parseable date to ISO 8601 UTC, so text comparison is time comparison. */
export function isoDate(value: string | Date | number): string {
  const d = value instanceof Date ? value : new Date(value);
  if (Number.isNaN(d.getTime())) throw new RangeError(`Invalid date: ${String(value)}`);
  return d.toISOString();
}

export class PricesRepo {
  readonly #sql: Sql;
  readonly #now: Clock;
  constructor(sql: Sql, now: Clock) {
    this.#sql = sql;
    this.#now = now;
  }

  /** Sets the price of (model, project, effective date), replacing one with the same key. */
  async set(input: SetPriceInput): Promise<Price> {
    const date = isoDate(input.effective_date);
    const project = input.project_id ?? null;
    return this.#sql.transaction(async (tx) => {
      const existing = await tx.one(
        `SELECT ${PRICE_ID.columns()} FROM prices WHERE model = $1 AND effective_date = $2
         AND ((project_id IS NULL AND CAST($3 AS TEXT) IS NULL) OR project_id = $3)`,
        [input.model, date, project],
      );
      const values = [
        input.model,
        project,
        input.prompt_token_cost,
        input.completion_token_cost,
        input.cache_read_input_token_cost ?? null,
        input.cache_creation_input_token_cost ?? null,
        date,
      ];
      const row = existing
        ? await tx.one(
            `UPDATE prices SET model = $2, project_id = $3, prompt_token_cost = $4,
               completion_token_cost = $5, cache_read_input_token_cost = $6,
               cache_creation_input_token_cost = $7, effective_date = $8
             WHERE id = $1 RETURNING ${PRICES.columns()}`,
            [PRICE_ID.read(existing).id, ...values],
          )
        : await tx.one(
            `INSERT INTO prices (${PRICES.columns()}, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING ${PRICES.columns()}`,
            [uuidv7(this.#now()), ...values, Math.floor(this.#now() / 1000)],
          );
      return PRICES.read(row!);
    });
  }

  /** Prices visible to a project (its own and the defaults), or only the defaults. */
  async list(options: { project_id?: string | null; model?: string } = {}): Promise<Price[]> {
    const rows = await this.#sql.query(
      `SELECT ${PRICES.columns()} FROM prices WHERE (project_id IS NULL OR project_id = $1)
         AND (CAST($2 AS TEXT) IS NULL OR model = $2)
       ORDER BY model, effective_date, project_id`,
      [options.project_id ?? null, options.model ?? null],
    );
    return rows.map(PRICES.read);
  }

  /** Deletes a price; a project may only delete its own (null = a default price). */
  async delete(projectId: string | null, id: string): Promise<void> {
    const n = await this.#sql.exec(
      "DELETE FROM prices WHERE id = $1 AND ((project_id IS NULL AND CAST($2 AS TEXT) IS NULL) OR project_id = $2)",
      [id, projectId],
    );
    if (n === 0) throw new NotFoundError(`Price ${id} not found`);
  }
}
