import { DomainError, type DomainErrorKind } from "@arbor/store";
import type { NextFunction, Request, Response } from "express";
import type { Logger } from "pino";

/** The two error envelopes: OpenAI's under `/v1`, the `detail` shape under `/calls` and `/call`. */
export type Surface = "v1" | "calls";

export function surfaceOf(path: string): Surface {
  return path.startsWith("/calls") || path.startsWith("/call/") ? "calls" : "v1";
}

/** One table maps status to OpenAI error type (ADR 2, "Two error envelopes, one status table"). */
const typeByStatus: Record<number, string> = {
  400: "invalid_request_error",
  401: "authentication_error",
  403: "permission_error",
  404: "not_found_error",
  405: "invalid_request_error",
  406: "invalid_request_error",
  409: "conflict_error",
  413: "invalid_request_error",
  415: "invalid_request_error",
  422: "invalid_request_error",
  429: "rate_limit_error",
  500: "server_error",
  501: "not_implemented_error",
  503: "server_error",
};

export function errorTypeFor(status: number): string {
  return typeByStatus[status] ?? (status >= 500 ? "server_error" : "invalid_request_error");
}

/** One entry of the `/calls` validation shape: `{loc, msg, type}`. */
export interface ValidationIssue {
  loc: (string | number)[];
  msg: string;
  type: string;
}

export interface ApiErrorOptions {
  code?: string | null;
  param?: string | null;
  headers?: Record<string, string>;
  /** Validation issues; under `/calls` they become a 422 `detail` list. */
  issues?: ValidationIssue[];
}

/** The one error class of the server. Anything else that is thrown becomes an opaque 500. */
export class ApiError extends Error {
  readonly status: number;
  readonly code: string | null;
  readonly param: string | null;
  readonly headers: Record<string, string>;
  readonly issues: ValidationIssue[] | undefined;

  constructor(status: number, message: string, options: ApiErrorOptions = {}) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = options.code ?? null;
    this.param = options.param ?? null;
    this.headers = options.headers ?? {};
    this.issues = options.issues;
  }

  static badRequest(message: string, param: string | null = null, code: string | null = null) {
    return new ApiError(400, message, { param, code });
  }
  static notFound(message: string, code: string | null = null) {
    return new ApiError(404, message, { code });
  }
  static conflict(message: string, code: string | null = null) {
    return new ApiError(409, message, { code });
  }
  static unauthorized(message: string) {
    return new ApiError(401, message, { code: "invalid_api_key" });
  }
  static forbidden(message: string) {
    return new ApiError(403, message, { code: "permission_denied" });
  }
  static tooLarge(message: string) {
    return new ApiError(413, message, { code: "request_too_large" });
  }
  static notImplemented(operationId: string) {
    return new ApiError(501, `${operationId} is not implemented yet.`, {
      code: "not_implemented",
    });
  }
}

/** The validator's errors (express-openapi-validator HttpError). */
interface ValidatorError {
  status: number;
  message: string;
  errors?: { path?: string; message: string; errorCode?: string }[];
  headers?: Record<string, string>;
}

function isValidatorError(err: unknown): err is ValidatorError {
  return (
    typeof err === "object" &&
    err !== null &&
    typeof (err as ValidatorError).status === "number" &&
    Array.isArray((err as ValidatorError).errors)
  );
}

/** An error from body-parser or another http-errors user: `status` is the client's fault when it
 * is a 4xx, and `type` (body-parser's) says which. */
interface HttpClientError {
  status: number;
  message: string;
  type?: string;
  code?: string;
}

function isHttpClientError(err: unknown): err is HttpClientError {
  if (typeof err !== "object" || err === null) return false;
  const e = err as HttpClientError;
  return typeof e.status === "number" && e.status >= 400 && e.status < 500;
}

/** A body that could not be read, decoded or parsed: 400 (422 under /calls, with a `loc`). */
function unreadableBody(message: string, code: string, type: string): ApiError {
  return new ApiError(400, message, { code, issues: [{ loc: ["body"], msg: message, type }] });
}

function fromHttpClientError(err: HttpClientError): ApiError {
  switch (err.type) {
    case "entity.too.large":
      return ApiError.tooLarge("Request body is too large.");
    case "entity.parse.failed":
      return new ApiError(400, "The request body is not valid JSON.", {
        code: "invalid_json",
        issues: [{ loc: ["body"], msg: "JSON decode error", type: "json_invalid" }],
      });
    case "entity.too.deep":
      return unreadableBody(err.message, "invalid_json", "json_invalid");
    case "charset.unsupported":
      return new ApiError(415, `${err.message}: send the body as UTF-8.`, {
        code: "unsupported_media_type",
      });
    case "encoding.unsupported":
      return new ApiError(
        415,
        `${err.message}: send the body uncompressed, or with gzip, deflate or br.`,
        { code: "unsupported_media_type" },
      );
  }
  if (err.code?.startsWith("Z_")) {
    // zlib could not inflate a body sent with Content-Encoding.
    return unreadableBody(
      "The request body does not decode with its Content-Encoding.",
      "invalid_encoding",
      "value_error",
    );
  }
  if (err.status === 413) return ApiError.tooLarge("Request body is too large.");
  if (err.status === 415) return new ApiError(415, err.message, { code: "unsupported_media_type" });
  return unreadableBody("The request body could not be read.", "invalid_body", "value_error");
}

/** `/body/messages/0/role` → `["body", "messages", 0, "role"]`. */
function locOf(path: string | undefined): (string | number)[] {
  if (!path) return ["body"];
  const parts = path
    .replace(/^\./, "")
    .split(/[/.]/)
    .filter((p) => p.length > 0)
    .map((p) => (/^\d+$/.test(p) ? Number(p) : p));
  if (parts[0] === "headers") parts[0] = "header";
  return parts.length > 0 ? parts : ["body"];
}

/** `["body", "messages", 0, "role"]` → `messages[0].role` (OpenAI's `param`). */
function paramOf(loc: (string | number)[]): string | null {
  const rest =
    loc[0] === "body" || loc[0] === "query" || loc[0] === "header" || loc[0] === "path"
      ? loc.slice(1)
      : loc;
  if (rest.length === 0) return null;
  return rest.reduce<string>(
    (acc, part) => (typeof part === "number" ? `${acc}[${part}]` : acc ? `${acc}.${part}` : part),
    "",
  );
}

/** AJV keyword + message → pydantic's `type` and `msg`, as FastAPI-style clients expect. */
function pydanticIssue(keyword: string, message: string): { type: string; msg: string } {
  const bound = /([<>]=?)\s*(-?[\d.]+)/.exec(message)?.[2];
  const count = /(\d+)/.exec(message)?.[1];
  switch (keyword) {
    case "required":
      return { type: "missing", msg: "Field required" };
    case "additionalProperties":
    case "unevaluatedProperties":
      return { type: "extra_forbidden", msg: "Extra inputs are not permitted" };
    case "minimum":
      return {
        type: "greater_than_equal",
        msg: `Input should be greater than or equal to ${bound}`,
      };
    case "exclusiveMinimum":
      return { type: "greater_than", msg: `Input should be greater than ${bound}` };
    case "maximum":
      return { type: "less_than_equal", msg: `Input should be less than or equal to ${bound}` };
    case "minLength":
      return {
        type: "string_too_short",
        msg: `String should have at least ${count} character${count === "1" ? "" : "s"}`,
      };
    case "maxLength":
      return { type: "string_too_long", msg: `String should have at most ${count} characters` };
    case "minItems":
      return {
        type: "too_short",
        msg: `List should have at least ${count} item${count === "1" ? "" : "s"}`,
      };
    case "maxItems":
      return { type: "too_long", msg: `List should have at most ${count} items` };
    case "pattern":
      return {
        type: "string_pattern_mismatch",
        msg: `String should ${message.replace(/^must /, "")}`,
      };
    case "enum":
      return { type: "enum", msg: `Input should be ${message.replace(/^must be /, "")}` };
    case "type": {
      const expected = /must be (\w+)/.exec(message)?.[1] ?? "";
      const named: Record<string, [string, string]> = {
        integer: ["int_type", "Input should be a valid integer"],
        number: ["float_type", "Input should be a valid number"],
        string: ["string_type", "Input should be a valid string"],
        boolean: ["bool_type", "Input should be a valid boolean"],
        array: ["list_type", "Input should be a valid list"],
        object: ["dict_type", "Input should be a valid dictionary"],
        null: ["none_required", "Input should be None"],
      };
      const [type, msg] = named[expected] ?? ["type_error", message];
      return { type, msg };
    }
    default:
      return { type: keyword || "value_error", msg: message };
  }
}

/** What busboy says of a multipart body it cannot parse. */
const MULTIPART_FAULT =
  /^(Unexpected end of (form|file)|Malformed part header|Part terminated early|Multipart: Boundary not found|Malformed urlencoded form)/i;

/** Turns whatever was thrown into an ApiError; unknown throwables become an opaque 500. */
export function toApiError(err: unknown): { error: ApiError; unexpected: boolean } {
  if (err instanceof ApiError) return { error: err, unexpected: false };
  if (err instanceof DomainError) return { error: fromDomainError(err), unexpected: false };
  // The validator's multipart parser reports a body it cannot parse as its own 500.
  if (isValidatorError(err) && err.status === 500 && MULTIPART_FAULT.test(err.message)) {
    const why = err.message.replace(/[.]$/, "");
    return {
      error: ApiError.badRequest(
        `The multipart/form-data body is malformed (${why}): send each file as a part with its boundary, or the files as one tar.`,
        null,
        "invalid_multipart",
      ),
      unexpected: false,
    };
  }
  if (isValidatorError(err) && err.status < 500) {
    const entries = err.errors ?? [];
    const issues = entries.map((e) => {
      const keyword = e.errorCode?.replace(/\.openapi\.(validation|requestValidation)$/, "") ?? "";
      return { loc: locOf(e.path), ...pydanticIssue(keyword, e.message) };
    });
    const firstLoc = issues[0]?.loc ?? ["body"];
    const status = err.status;
    if (status === 404) return { error: ApiError.notFound("Unknown path."), unexpected: false };
    if (status === 405) {
      return {
        error: new ApiError(405, "Method not allowed for this path.", {
          code: "method_not_allowed",
          headers: err.headers ?? {},
        }),
        unexpected: false,
      };
    }
    if (status === 415) {
      return {
        error: new ApiError(415, err.message, { code: "unsupported_media_type" }),
        unexpected: false,
      };
    }
    if (status === 413)
      return { error: ApiError.tooLarge("Request body is too large."), unexpected: false };
    const named = mostSpecific(entries, issues);
    const namedLoc = named?.loc ?? firstLoc;
    const param = paramOf(namedLoc);
    const where = param ?? namedLoc.join(".");
    const message = named ? `${where}: ${named.message}` : err.message;
    return {
      error: new ApiError(status === 401 || status === 403 ? status : 400, message, {
        param,
        issues: status === 400 ? issues : undefined,
      }),
      unexpected: false,
    };
  }
  if (isHttpClientError(err)) return { error: fromHttpClientError(err), unexpected: false };
  return {
    error: new ApiError(500, "Internal server error."),
    unexpected: true,
  };
}

/**
 * The error that names what was meant. Where a value may be one of several shapes (`oneOf`,
 * `anyOf`, `if`/`then`/`else`), the validator reports each shape's complaint: the one deepest in
 * the value went furthest into a shape that fits, and a complaint about the shape itself (a
 * missing or different discriminating key, "must match") says least.
 */
function mostSpecific(
  entries: readonly NonNullable<ValidatorError["errors"]>[number][],
  issues: readonly { loc: (string | number)[] }[],
): { loc: (string | number)[]; message: string } | undefined {
  const vague =
    /^must (have required property|be equal to constant|match (a|exactly one) schema|match "(then|else)" schema)/;
  let best: { loc: (string | number)[]; message: string; rank: number } | undefined;
  entries.forEach((entry, i) => {
    const loc = issues[i]!.loc;
    const rank = loc.length * 2 + (vague.test(entry.message) ? 0 : 1);
    if (!best || rank > best.rank) best = { loc, message: entry.message, rank };
  });
  return best;
}

/** The one table from a domain error's kind to its status. */
const statusByKind: Record<DomainErrorKind, number> = {
  invalid: 400,
  not_found: 404,
  conflict: 409,
  forbidden: 403,
  too_large: 413,
  rate_limited: 429,
  unavailable: 503,
};

/** A domain error as a response: its kind's status, its code and param; an invalid input under
 * /calls is a 422 whose `loc` is the param's path. */
function fromDomainError(err: DomainError): ApiError {
  const status = statusByKind[err.kind];
  const headers: Record<string, string> = {};
  if (err.retryAfterSeconds !== undefined) headers["retry-after"] = String(err.retryAfterSeconds);
  if (err.kind === "unavailable") headers["x-should-retry"] = "true";
  if (err.shouldRetry !== undefined) headers["x-should-retry"] = String(err.shouldRetry);
  const message = /[.?!]$/.test(err.message) ? err.message : `${err.message}.`;
  return new ApiError(status, message, {
    code: err.code,
    param: err.param,
    headers,
    ...(err.kind === "invalid"
      ? {
          issues: [
            {
              loc: ["body", ...(err.param ? locOfParam(err.param) : [])],
              msg: err.message,
              type: "value_error",
            },
          ],
        }
      : {}),
  });
}

/** `messages[0].role` → `["messages", 0, "role"]`. */
function locOfParam(param: string): (string | number)[] {
  return param
    .split(/[.[\]]/)
    .filter((p) => p !== "")
    .map((p) => (/^\d+$/.test(p) ? Number(p) : p));
}

/** The body of an error response in the surface's envelope, and its status. */
export function envelope(
  surface: Surface,
  error: ApiError,
  requestId: string,
): { status: number; body: unknown } {
  if (surface === "calls") {
    if (error.issues && (error.status === 400 || error.status === 422)) {
      return { status: 422, body: { detail: error.issues } };
    }
    const message =
      error.status === 500 ? `Internal server error (request ${requestId}).` : error.message;
    return { status: error.status, body: { detail: message } };
  }
  const message =
    error.status === 500 ? `Internal server error (request ${requestId}).` : error.message;
  return {
    status: error.status,
    body: {
      error: { message, type: errorTypeFor(error.status), param: error.param, code: error.code },
    },
  };
}

/** Sends an error in the surface's envelope. It bypasses response validation on purpose: the
 * envelopes are built only here, and a unit test checks them against the spec's schemas. */
export function sendError(
  res: Response,
  surface: Surface,
  error: ApiError,
  requestId: string,
): void {
  const { status, body } = envelope(surface, error, requestId);
  for (const [name, value] of Object.entries(error.headers)) res.setHeader(name, value);
  if (status === 503 && !res.hasHeader("x-should-retry")) res.setHeader("x-should-retry", "true");
  res.status(status).type("application/json").send(JSON.stringify(body));
}

/** The central error middleware: the only place errors turn into responses. */
export function errorHandler(logger: Logger) {
  return (err: unknown, req: Request, res: Response, _next: NextFunction): void => {
    const { error, unexpected } = toApiError(err);
    const requestId = res.locals.requestId as string;
    if (unexpected || error.status >= 500) {
      logger.error({ err, requestId, method: req.method, path: req.path }, "request failed");
    }
    if (res.headersSent) {
      // An SSE stream already started: the error goes out as an event, then the stream ends.
      if (res.getHeader("content-type")?.toString().startsWith("text/event-stream")) {
        const { body } = envelope("v1", error, requestId);
        res.write(`data: ${JSON.stringify(body)}\n\n`);
      }
      res.end();
      return;
    }
    sendError(res, surfaceOf(req.path), error, requestId);
  };
}
