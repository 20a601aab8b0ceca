import type { SqlValue } from "./sql.ts";

/** A page of a list, in the wire's shape minus `object`. */
export interface Page<T> {
  data: T[];
  first_id: string | null;
  last_id: string | null;
  has_more: boolean;
}

export interface PageOptions {
  /** The id of the last item seen. */
  after?: string | null;
  /** 1–1000, default 20. */
  limit?: number;
}

export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/** What a caller may hand in to be stored as JSON: `Json`, with absent (undefined) members,
 * which are left out as `JSON.stringify` leaves them. Typed objects of the spec fit it as they
 * are. */
export type JsonInput =
  | null
  | boolean
  | number
  | string
  | undefined
  | readonly JsonInput[]
  | { readonly [key: string]: JsonInput };

export function pageLimit(limit: number | undefined): number {
  if (limit === undefined || !Number.isFinite(limit)) return 20;
  return Math.min(1000, Math.max(1, Math.floor(limit)));
}

/** Rows were fetched with LIMIT limit+1; the extra row only says there is more. */
export function toPage<T extends { id: string }>(rows: T[], limit: number): Page<T> {
  const has_more = rows.length > limit;
  const data = has_more ? rows.slice(0, limit) : rows;
  return {
    data,
    first_id: data[0]?.id ?? null,
    last_id: data[data.length - 1]?.id ?? null,
    has_more,
  };
}

export function toJson(value: unknown): string | null {
  return value === undefined || value === null ? null : JSON.stringify(value);
}

/** `$from, $from+1, …` for n values: builds IN lists and multi-row VALUES. */
export function placeholders(n: number, from: number): string {
  return Array.from({ length: n }, (_, i) => `$${from + i}`).join(", ");
}

export type Params = SqlValue[];

export type Clock = () => number;

/** JSON with sorted keys: equal content gives an equal hash whatever the key order. */
export function canonical(value: unknown): string {
  if (value === null || typeof value !== "object") return JSON.stringify(value ?? null);
  if (Array.isArray(value)) return `[${value.map(canonical).join(",")}]`;
  const obj = value as Record<string, unknown>;
  const keys = Object.keys(obj)
    .filter((k) => obj[k] !== undefined)
    .sort();
  return `{${keys.map((k) => `${JSON.stringify(k)}:${canonical(obj[k])}`).join(",")}}`;
}
