/** Error classes named as openai-node names them, so code that handles one handles the other. */
export class ArborError extends Error {
  override name = "ArborError";
}

/** An HTTP error answer from the server. Carries the status, the request id and the parsed body. */
export class APIError extends ArborError {
  override name = "APIError";
  readonly status: number;
  readonly requestId: string | null;
  readonly headers: Headers;
  /** The parsed error body: `{error: {...}}` under `/v1`, `{detail: ...}` under `/calls`. */
  readonly body: unknown;
  /** OpenAI envelope fields, when the body has them. */
  readonly type: string | null;
  readonly code: string | null;
  readonly param: string | null;

  constructor(status: number, body: unknown, headers: Headers) {
    super(messageOf(status, body));
    this.status = status;
    this.body = body;
    this.headers = headers;
    this.requestId = headers.get("x-request-id");
    const error = openAiError(body);
    this.type = error?.type ?? null;
    this.code = error?.code ?? null;
    this.param = error?.param ?? null;
  }

  /** The subclass for a status, as openai-node picks it. */
  static from(status: number, body: unknown, headers: Headers): APIError {
    const Class = classByStatus[status] ?? (status >= 500 ? InternalServerError : APIError);
    return new Class(status, body, headers);
  }
}

export class BadRequestError extends APIError {
  override name = "BadRequestError";
}
export class AuthenticationError extends APIError {
  override name = "AuthenticationError";
}
export class PermissionDeniedError extends APIError {
  override name = "PermissionDeniedError";
}
export class NotFoundError extends APIError {
  override name = "NotFoundError";
}
export class ConflictError extends APIError {
  override name = "ConflictError";
}
export class PayloadTooLargeError extends APIError {
  override name = "PayloadTooLargeError";
}
export class UnprocessableEntityError extends APIError {
  override name = "UnprocessableEntityError";
}
export class RateLimitError extends APIError {
  override name = "RateLimitError";
}
export class InternalServerError extends APIError {
  override name = "InternalServerError";
}
export class NotImplementedError extends InternalServerError {
  override name = "NotImplementedError";
}

/** The request never got an HTTP answer (refused, reset, DNS), after all retries. */
export class APIConnectionError extends ArborError {
  override name = "APIConnectionError";
  constructor(cause: unknown) {
    super(`Connection error: ${cause instanceof Error ? cause.message : String(cause)}`, { cause });
  }
}

/** No answer's headers came within the request's timeout, after all retries. */
export class APIConnectionTimeoutError extends APIConnectionError {
  override name = "APIConnectionTimeoutError";
  constructor(timeoutMs: number) {
    super(new Error(`Request timed out after ${timeoutMs} ms.`));
  }
}

/** The caller aborted the request through its AbortSignal. */
export class APIUserAbortError extends ArborError {
  override name = "APIUserAbortError";
  constructor() {
    super("Request was aborted.");
  }
}

const classByStatus: Record<number, typeof APIError> = {
  400: BadRequestError,
  401: AuthenticationError,
  403: PermissionDeniedError,
  404: NotFoundError,
  409: ConflictError,
  413: PayloadTooLargeError,
  422: UnprocessableEntityError,
  429: RateLimitError,
  501: NotImplementedError,
};

interface OpenAiErrorBody {
  message?: string;
  type?: string;
  code?: string | null;
  param?: string | null;
}

function openAiError(body: unknown): OpenAiErrorBody | undefined {
  if (typeof body === "object" && body !== null && "error" in body) {
    const error = (body as { error: unknown }).error;
    if (typeof error === "object" && error !== null) return error as OpenAiErrorBody;
  }
  return undefined;
}

function messageOf(status: number, body: unknown): string {
  const error = openAiError(body);
  if (error?.message) return `${status} ${error.message}`;
  if (typeof body === "object" && body !== null && "detail" in body) {
    const detail = (body as { detail: unknown }).detail;
    if (typeof detail === "string") return `${status} ${detail}`;
    if (Array.isArray(detail)) {
      const parts = detail.map(
        (d: { loc?: unknown[]; msg?: string }) => `${(d.loc ?? []).join(".")}: ${d.msg}`,
      );
      return `${status} ${parts.join("; ")}`;
    }
  }
  return `${status} status code (no body)`;
}

/** The result of an openapi-fetch call: data on success, the parsed error body otherwise. */
export interface FetchResult<T> {
  data?: T;
  error?: unknown;
  response: Response;
}

/** Returns the data of a successful result, or throws the APIError subclass for its status. */
export function unwrap<T>(result: FetchResult<T>): T {
  if (result.response.ok && result.error === undefined) return result.data as T;
  throw APIError.from(result.response.status, result.error, result.response.headers);
}
