/**
 * The domain's errors, with no HTTP in them: a `kind` (what went wrong, in the caller's terms),
 * an optional machine-readable `code` and the `param` at fault. The store throws them, and so do
 * the training package and the server's services, since every domain layer depends on the store;
 * only the HTTP layer turns a kind into a status (one table, `apps/server/src/http/errors.ts`).
 */
export type DomainErrorKind =
  | "invalid"
  | "not_found"
  | "conflict"
  | "forbidden"
  | "too_large"
  | "rate_limited"
  | "unavailable";

export interface DomainErrorOptions {
  code?: string | null;
  param?: string | null;
  /** For `unavailable` and `rate_limited`: when to try again, in seconds. */
  retryAfterSeconds?: number;
  /** Whether a client should retry the same request (`x-should-retry`); unsaid when unset. */
  shouldRetry?: boolean;
}

export class DomainError extends Error {
  override name = "DomainError";
  readonly kind: DomainErrorKind;
  readonly code: string | null;
  readonly param: string | null;
  readonly retryAfterSeconds: number | undefined;
  readonly shouldRetry: boolean | undefined;
  constructor(kind: DomainErrorKind, message: string, options: DomainErrorOptions = {}) {
    super(message);
    this.kind = kind;
    this.code = options.code ?? null;
    this.param = options.param ?? null;
    this.retryAfterSeconds = options.retryAfterSeconds;
    this.shouldRetry = options.shouldRetry;
  }
}

/** A uniqueness rule was broken (duplicate model name, a call start repeated with new content…). */
export class ConflictError extends DomainError {
  override name = "ConflictError";
  constructor(message: string, options: DomainErrorOptions = {}) {
    super("conflict", message, options);
  }
}

/** The row does not exist for this tenant (it may exist for another one: that reads the same). */
export class NotFoundError extends DomainError {
  override name = "NotFoundError";
  constructor(message: string, options: DomainErrorOptions = {}) {
    super("not_found", message, options);
  }
}

/** A value the domain will not keep or act on: a name outside the grammar, a NUL character, a
 * job too large to plan. Refused the same way on every backend. */
export class InvalidInputError extends DomainError {
  override name = "InvalidInputError";
  constructor(message: string, options: DomainErrorOptions = {}) {
    super("invalid", message, options);
  }
}

/** The caller may not act for that entity. */
export class ForbiddenError extends DomainError {
  override name = "ForbiddenError";
  constructor(message: string, options: DomainErrorOptions = {}) {
    super("forbidden", message, options);
  }
}

/** Something the request needs is down (a store that cannot record, an upstream). */
export class UnavailableError extends DomainError {
  override name = "UnavailableError";
  constructor(message: string, options: DomainErrorOptions = {}) {
    super("unavailable", message, options);
  }
}

/** A request touches more than the caller allowed or the domain can take; nothing was done. */
export class LimitExceededError extends DomainError {
  override name = "LimitExceededError";
  readonly matched: number;
  readonly limit: number;
  /** The trace that alone does not fit the limit, when that is the reason. */
  readonly traceId: string | null;
  constructor(matched: number, limit: number, traceId: string | null = null) {
    super(
      "too_large",
      traceId === null
        ? `The requested calls match ${matched} calls, more than the limit of ${limit}; ask for fewer call ids per request`
        : `Trace ${quote(traceId)} alone holds ${matched} calls, more than the limit of ${limit} calls summed in one batch, and usage is never summed in part: ask again with a larger limit`,
      { code: "request_too_large" },
    );
    this.matched = matched;
    this.limit = limit;
    this.traceId = traceId;
  }
}

/** At most `max` characters of something a caller sent, quoted, for an error message: an error
 * never echoes a whole 200 KB input. */
export function quote(value: unknown, max = 64): string {
  const text = typeof value === "string" ? value : String(value);
  return JSON.stringify(text.length > max ? `${text.slice(0, max)}…` : text);
}

/** Names of entities, projects, models and splits: 1–128 letters, digits, `.`, `_`, `-`, and
 * neither `.` nor `..` (the spec's `Name`). */
export const NAME_PATTERN = /^(?!\.\.?$)[A-Za-z0-9._-]{1,128}$/;

/** Throws InvalidInputError unless `value` is a name. */
export function assertName(value: string, what: string): void {
  if (!NAME_PATTERN.test(value)) {
    throw new InvalidInputError(
      `${what} must be 1–128 letters, digits, ".", "_" or "-" (and not "." or ".."), got ${quote(value)}`,
      { code: "invalid_value" },
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
