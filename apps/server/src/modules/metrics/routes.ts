import type { MetricsAccess } from "@arbor/config";
import { type NextFunction, type Request, type Response, Router } from "express";
import { type Authenticate, bearerToken } from "../../http/auth.ts";
import { ApiError } from "../../http/errors.ts";
import type { Metrics } from "./metrics.ts";

export interface MetricsEndpointDeps {
  /** `ARBOR_METRICS`: operator keys only, anyone, or no one. */
  access: MetricsAccess;
  metrics: Metrics;
  authenticate: Authenticate;
}

/**
 * `GET /metrics`: Prometheus' text format, for a scraper rather than a client of the API, so it
 * is served beside the validated operations like `/docs` (ADR 34), by every role. With
 * `key`, no or a bad key is 401 and a key that is not an operator's is 403 (ADR 50), in the
 * `/v1` envelope; `off` answers 404 as an unknown path does.
 */
export function metricsEndpoint(deps: MetricsEndpointDeps): Router {
  const router = Router();
  if (deps.access === "off") {
    router.all("/metrics", (_req, _res, next) => next(ApiError.notFound("Unknown path.")));
    return router;
  }
  router.get("/metrics", (req: Request, res: Response, next: NextFunction) => {
    scrape(deps, req, res).catch(next);
  });
  return router;
}

async function scrape(deps: MetricsEndpointDeps, req: Request, res: Response): Promise<void> {
  if (deps.access === "key") {
    const principal = await deps.authenticate(bearerToken(req));
    if (!principal) throw ApiError.unauthorized("Invalid API key.");
    if (!principal.operator) {
      throw ApiError.forbidden(
        "Only an operator key may read the metrics (arbor keys create --operator).",
      );
    }
  }
  const { registry } = deps.metrics;
  const text = await registry.metrics();
  res.status(200).type(registry.contentType).send(text);
}

/** Counts every request with its operation, status and duration when its response ends. A
 * response cut off before its status was sent (the client left) counts as 499. */
export function requestMetrics(metrics: Metrics) {
  return (_req: Request, res: Response, next: NextFunction): void => {
    const start = performance.now();
    res.on("close", () => {
      const status = res.headersSent ? res.statusCode : 499;
      metrics.request(res.locals.operationId, status, (performance.now() - start) / 1000);
    });
    next();
  };
}
