/** Base class of every error the store throws on purpose; callers map these to HTTP statuses. */
export class StoreError extends Error {
  override name = "StoreError";
}

/** A uniqueness rule was broken (duplicate model name, a call start repeated with new content…). */
export class ConflictError extends StoreError {
  override name = "ConflictError";
}

/** The row does not exist for this tenant (it may exist for another one: that reads the same). */
export class NotFoundError extends StoreError {
  override name = "NotFoundError";
}

/** A request touches more rows than the caller allowed; nothing was computed. */
export class LimitExceededError extends StoreError {
  override name = "LimitExceededError";
  readonly matched: number;
  readonly limit: number;
  constructor(matched: number, limit: number) {
    super(
      `The requested calls match ${matched} calls, more than the limit of ${limit}; ask for fewer call ids per request`,
    );
    this.matched = matched;
    this.limit = limit;
  }
}

/** A value the store will not keep (a name outside the grammar, a NUL character in a string);
 * refused the same way on every backend. */
export class InvalidInputError extends StoreError {
  override name = "InvalidInputError";
}

/** Names of entities, projects, models and splits: 1–128 letters, digits, `.`, `_`, `-`, and
 * neither `.` nor `..` (the spec's `Name`). */
export const NAME_PATTERN = /^(?!\.\.?$)[A-Za-z0-9._-]{1,128}$/;

/** Throws InvalidInputError unless `value` is a name. */
export function assertName(value: string, what: string): void {
  if (!NAME_PATTERN.test(value)) {
    throw new InvalidInputError(
      `${what} must be 1–128 letters, digits, ".", "_" or "-" (and not "." or ".."), got ${JSON.stringify(value.length > 64 ? `${value.slice(0, 64)}…` : value)}`,
    );
  }
}

/** The driver's unique-violation error, whatever the backend. */
export function isUniqueViolation(err: unknown): boolean {
  if (typeof err !== "object" || err === null) return false;
  const e = err as { code?: unknown; errcode?: unknown; message?: unknown };
  if (e.code === "23505") return true; // PostgreSQL unique_violation
  const message = typeof e.message === "string" ? e.message : "";
  return message.includes("UNIQUE constraint failed");
}
