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

/** The driver's unique-violation error, whatever the backend. */
export function isUniqueViolation(err: unknown): boolean {
  if (typeof err !== "object" || err === null) return false;
  const e = err as { code?: unknown; errcode?: unknown; message?: unknown };
  if (e.code === "23505") return true; // PostgreSQL unique_violation
  const message = typeof e.message === "string" ? e.message : "";
  return message.includes("UNIQUE constraint failed");
}
