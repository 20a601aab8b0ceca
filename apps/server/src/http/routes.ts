import { type NextFunction, type Request, type Response, Router } from "express";
import { ApiError } from "./errors.ts";
import type { SpecOperation } from "./openapi.ts";
import type { Handler, Handlers, OperationId } from "./operations.ts";
import { RESPONDED } from "./operations.ts";
import type { Principal } from "./principal.ts";

/** Mounts one route per spec operation. An operation with no handler answers 501, so every
 * operation is routed by construction and the pending ones are derived, never listed by hand. */
export function mountOperations(operations: SpecOperation[], handlers: Handlers): Router {
  // strict: `/v1/chat/completions/` is its own operation.
  const router = Router({ strict: true });
  for (const op of operations) {
    const handler = handlers[op.operationId] as Handler<OperationId> | undefined;
    router[op.method](op.expressPath, (req: Request, res: Response, next: NextFunction) => {
      res.locals.operationId = op.operationId;
      if (!handler) return next(ApiError.notImplemented(op.operationId));
      run(handler, req, res).catch(next);
    });
  }
  return router;
}

async function run(handler: Handler<OperationId>, req: Request, res: Response): Promise<void> {
  const result = await handler({
    body: req.body,
    params: req.params as never,
    query: req.query as never,
    principal: (res.locals.principal as Principal | undefined) ?? null,
    req,
    res,
  });
  if (result === RESPONDED) return;
  res.status(200).json(result);
}

/** The operations of the spec that have no handler yet: they answer 501. */
export function pendingOperations(operations: SpecOperation[], handlers: Handlers): OperationId[] {
  return operations.filter((op) => !handlers[op.operationId]).map((op) => op.operationId);
}
