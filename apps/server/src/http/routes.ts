import { type NextFunction, type Request, type Response, Router } from "express";
import { ApiError } from "./errors.ts";
import type { SpecOperation } from "./openapi.ts";
import {
  type Handler,
  type Handlers,
  type OperationId,
  type PathParams,
  type PublicHandler,
  type PublicInput,
  type QueryParams,
  RESPONDED,
  type RequestBody,
} from "./operations.ts";

/** Mounts one route per spec operation. An operation with no handler answers 501, so every
 * operation is routed by construction and the pending ones are derived, never listed by hand. */
export function mountOperations(operations: SpecOperation[], handlers: Handlers): Router {
  // strict: `/v1/chat/completions/` is its own operation.
  const router = Router({ strict: true });
  for (const op of operations) {
    // One signature for all: each handler is typed by its own operation where it is written.
    const handler = handlers[op.operationId] as Handler<OperationId> | undefined;
    router[op.method](op.expressPath, (req: Request, res: Response, next: NextFunction) => {
      res.locals.operationId = op.operationId;
      if (!handler) return next(ApiError.notImplemented(op.operationId));
      run(op, handler, req, res).catch(next);
    });
  }
  return router;
}

/** Names each request's operation (`res.locals.operationId`) as soon as it arrives, so what
 * answers before its route (a 401, a 429, a validation error) is still counted under it. */
export function tagOperations(operations: SpecOperation[]): Router {
  const router = Router({ strict: true });
  for (const op of operations) {
    router[op.method](op.expressPath, (_req: Request, res: Response, next: NextFunction) => {
      res.locals.operationId = op.operationId;
      next();
    });
  }
  return router;
}

async function run(
  op: SpecOperation,
  handler: Handler<OperationId>,
  req: Request,
  res: Response,
): Promise<void> {
  // The validator has checked body, params and query against this operation; an integer in
  // the path reaches the handler as a number, and only as digits (`1e3`, `0x10`, `1.0` are not
  // steps, whatever JSON Schema's coercion makes of them).
  const params: Record<string, unknown> = { ...req.params };
  for (const name of op.integerParams) {
    const raw = String(req.params[name] ?? "");
    if (!/^-?\d{1,15}$/.test(raw)) {
      throw ApiError.badRequest(`${name}: must be an integer, written in digits.`, name);
    }
    params[name] = Number(raw);
  }
  const input: PublicInput<OperationId> = {
    body: req.body as RequestBody<OperationId>,
    params: params as PathParams<OperationId>,
    query: req.query as QueryParams<OperationId>,
    req,
    res,
  };
  let result: Awaited<ReturnType<Handler<OperationId>>>;
  if (op.public) {
    result = await (handler as PublicHandler<OperationId>)(input);
  } else {
    // `authentication` sets both on every operation that is not public.
    const { principal, project } = res.locals;
    if (!principal || !project) throw ApiError.unauthorized("Missing API key.");
    result = await handler({ ...input, principal, project });
  }
  if (result === RESPONDED) return;
  res.status(200).json(result);
}

/** The operations of the spec that have no handler yet: they answer 501. */
export function pendingOperations(operations: SpecOperation[], handlers: Handlers): OperationId[] {
  return operations.filter((op) => !handlers[op.operationId]).map((op) => op.operationId);
}
