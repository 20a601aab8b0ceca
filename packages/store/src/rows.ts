import type { Json } from "./common.ts";
import type { Row } from "./sql.ts";

/**
 * Rows as the drivers return them, read into typed records. The two drivers differ: node:sqlite
 * gives integers as numbers (bigints past 2^53 when asked to), flags as 0/1 and bytes as
 * Uint8Array; pg gives int8 and numeric as numbers (its parser in `sql.ts`), the rest by column
 * type, bytea as a Buffer. JSON is text on both. A reader turns one column's value into its JS
 * type whatever the driver, and a table's `rowSchema` declares its columns once: the reader of
 * each, the record's type, and the column list its queries select.
 */
export type Reader<T> = (value: unknown) => T;

/** Text; `T` narrows it to the union the column keeps to (a CHECK, or the code writing it). */
export const str = <T extends string = string>(value: unknown): T => String(value) as T;

export const strOrNull = <T extends string = string>(value: unknown): T | null =>
  value === null || value === undefined ? null : (String(value) as T);

/** A number from a number, a bigint or numeric text. */
export const num = (value: unknown): number => (typeof value === "number" ? value : Number(value));

export const numOrNull = (value: unknown): number | null =>
  value === null || value === undefined ? null : Number(value);

/** An INTEGER 0/1 flag (neither store keeps a boolean type). */
export const bool = (value: unknown): boolean => Number(value) === 1;

/** JSON text, parsed; null for SQL NULL. */
export const json = <T = Json>(value: unknown): T | null =>
  typeof value === "string" ? (JSON.parse(value) as T) : null;

/** JSON text, parsed; a fresh `{}` for SQL NULL. */
export const jsonOrEmpty = <T = Json>(value: unknown): T => json<T>(value) ?? ({} as T);

/** Bytes (pg: a Buffer; node:sqlite: a Uint8Array), as a Buffer. */
export const bytes = (value: unknown): Buffer =>
  Buffer.isBuffer(value) ? value : Buffer.from(value as Uint8Array);

export type Shape = Readonly<Record<string, Reader<unknown>>>;

/** The record a shape reads: each column as its reader returns it. */
type Fields<S extends Shape> = { -readonly [K in keyof S]: ReturnType<S[K]> };

/** The record a schema reads. */
export type RowOf<R extends { read(row: Row): unknown }> = ReturnType<R["read"]>;

export interface RowSchema<S extends Shape> {
  /** The columns in declaration order, comma-separated (each prefixed `alias.` when given):
   * the list a SELECT or RETURNING reads. */
  columns(alias?: string): string;
  /** A row of a query that selected `columns()`, as the record. */
  read(row: Row): Fields<S>;
  /** The schema of some of the columns, for a query that reads only those. */
  pick<K extends keyof S & string>(...keys: K[]): RowSchema<Pick<S, K>>;
}

/** Declares a table's columns (or a query's) once: name → reader, in the order selected. */
export function rowSchema<S extends Shape>(shape: S): RowSchema<S> {
  const entries = Object.entries(shape);
  const names = entries.map(([name]) => name);
  const list = names.join(", ");
  return {
    columns: (alias) => (alias === undefined ? list : names.map((n) => `${alias}.${n}`).join(", ")),
    read(row) {
      const record: Record<string, unknown> = {};
      for (const [name, read] of entries) record[name] = read(row[name]);
      return record as Fields<S>;
    },
    pick: <K extends keyof S & string>(...keys: K[]) =>
      rowSchema(Object.fromEntries(keys.map((k) => [k, shape[k]])) as Pick<S, K>),
  };
}
