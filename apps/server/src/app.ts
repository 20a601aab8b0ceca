import type { KeyIdentity } from "@arbor/store";
import { ADAPTER_MAX_BYTES } from "@arbor/training";
import express, { type Express, type NextFunction, type Request, type Response } from "express";
import * as OpenApiValidator from "express-openapi-validator";
import type { Logger } from "pino";
import type { Role } from "./config.ts";
import { type Authenticate, authentication } from "./http/auth.ts";
import { jsonBody } from "./http/body.ts";
import { ApiError, errorHandler } from "./http/errors.ts";
import { specOperations } from "./http/openapi.ts";
import { requestId } from "./http/request-id.ts";
import { mountOperations, pendingOperations, tagOperations } from "./http/routes.ts";
import { securityHeaders } from "./http/security-headers.ts";
import { multipartBlocks } from "./http/uploads.ts";
import type { Principal } from "./modules/access.ts";
import { baseModelsModule } from "./modules/base-models/module.ts";
import { withItemsValidatedSeparately } from "./modules/calls/items.ts";
import { callsModule } from "./modules/calls/module.ts";
import { consoleModule } from "./modules/console/module.ts";
import { datasetsModule } from "./modules/datasets/module.ts";
import { docsModule } from "./modules/docs/module.ts";
import { fineTuningModule } from "./modules/fine-tuning/module.ts";
import { healthModule } from "./modules/health/module.ts";
import { inferenceModule } from "./modules/inference/module.ts";
import { metricsModule } from "./modules/metrics/module.ts";
import { requestMetrics } from "./modules/metrics/routes.ts";
import { modelsModule } from "./modules/models/module.ts";
import {
  type AppDeps,
  type ModuleDeps,
  moduleHandlers,
  type ServerModule,
} from "./modules/module.ts";
import { tinkerModule } from "./modules/tinker/module.ts";
import { trainingModule } from "./modules/training/module.ts";
import { trainingRunsModule } from "./modules/training-runs/module.ts";

export type { AppDeps } from "./modules/module.ts";

type ValidatorSpec = Exclude<Parameters<typeof OpenApiValidator.middleware>[0]["apiSpec"], string>;

/** The modules, in the order each stage of the app mounts them (ADR 54). */
const MODULES: readonly ServerModule[] = [
  docsModule,
  consoleModule,
  metricsModule,
  inferenceModule,
  datasetsModule,
  modelsModule,
  healthModule,
  callsModule,
  trainingModule,
  trainingRunsModule,
  fineTuningModule,
  baseModelsModule,
  tinkerModule,
];

/** Builds the app from its dependencies. It never listens: `main.ts` does, tests use port 0. */
export function createApp(deps: AppDeps): Express {
  const { config, logger, spec } = deps;
  const app = express();
  app.disable("x-powered-by");
  app.set("query parser", "extended");

  const authenticate: Authenticate = async (token) =>
    principalOf(await deps.store.apiKeys.verify(token));
  const moduleDeps: ModuleDeps = { ...deps, authenticate };
  app.use(requestId);
  app.use(securityHeaders());
  app.use(accessLog(logger));
  app.use(requestMetrics(deps.metrics));
  for (const module of MODULES) module.beforeAuthentication?.(app, moduleDeps);
  // Roles: a deployment may serve only some surfaces; the others' paths answer 404 here.
  const operations = specOperations(spec).filter((op) =>
    config.roles.some((role) => servesPath(role, op.path)),
  );
  app.use(tagOperations(operations));
  const publicPaths = new Set(operations.filter((op) => op.public).map((op) => op.path));
  app.use(authentication(authenticate, publicPaths));
  for (const module of MODULES) module.beforeValidation?.(app, moduleDeps);
  app.use(jsonBody(64 * 1024 * 1024));

  // With both checks off the validator still matches every path on every request: leave it out.
  if (config.validateRequests || config.validateResponses) {
    app.use(
      OpenApiValidator.middleware({
        // The validator keeps references into the document; give it its own copy.
        // The bundle passed Redocly's lint; our document type is only looser than the validator's.
        // Arrays marked x-validate-items-separately take any items here; their operation
        // checks each item itself (upsertCallBatch, ADR 37).
        apiSpec: withItemsValidatedSeparately(structuredClone(spec)) as unknown as ValidatorSpec,
        validateRequests: config.validateRequests ? { allowUnknownQueryParameters: false } : false,
        validateResponses: config.validateResponses ? { removeAdditional: false } : false,
        validateSecurity: false,
        validateFormats: true,
        // multipart/form-data bodies (adapter uploads and OpenAI's file uploads): in memory,
        // capped, kept in blocks that the adapter check's thread joins. Each operation's schema
        // says which parts and fields it takes.
        fileUploader: {
          storage: multipartBlocks,
          limits: { fileSize: ADAPTER_MAX_BYTES, files: 2, fields: 4, fieldSize: 1024 },
        },
        $refParser: { mode: "dereference" },
      }),
    );
  }

  const handlers = moduleHandlers(MODULES, moduleDeps);
  app.use(mountOperations(operations, handlers));
  // The operations answering 501 until their issue lands; the contract tests compare it.
  app.locals.pendingOperations = pendingOperations(operations, handlers);
  app.use((_req: Request, _res: Response, next: NextFunction) =>
    next(ApiError.notFound("Unknown path.")),
  );
  app.use(errorHandler(logger));
  return app;
}

function accessLog(logger: Logger) {
  return (req: Request, res: Response, next: NextFunction): void => {
    const start = performance.now();
    res.on("finish", () => {
      logger.info(
        {
          requestId: res.locals.requestId,
          method: req.method,
          path: req.path,
          operationId: res.locals.operationId,
          status: res.statusCode,
          ms: Math.round((performance.now() - start) * 10) / 10,
        },
        "request",
      );
    });
    next();
  };
}

function principalOf(identity: KeyIdentity | undefined): Principal | null {
  if (!identity) return null;
  return {
    keyId: identity.key_id,
    userId: identity.user_id,
    userName: identity.user_name,
    defaultEntity: identity.default_entity,
    entities: identity.entities,
    operator: identity.operator,
  };
}

/** Which paths each surface serves (ADR 1) (health and chat belong to more than one). */
export function servesPath(role: Role, path: string): boolean {
  if (path === "/v1/health" || path === "/v1/system-check") return true;
  const chat = path.startsWith("/v1/chat/completions") || path === "/v1/responses";
  switch (role) {
    case "training":
      return (
        chat ||
        path.startsWith("/v1/preview/") ||
        path.startsWith("/v1/training/") ||
        // OpenAI's files and fine-tuning jobs (ADR 70).
        path.startsWith("/v1/files") ||
        path.startsWith("/v1/fine_tuning/")
      );
    case "inference":
      return chat || path.startsWith("/v1/models");
    case "calls":
      return path.startsWith("/calls") || path.startsWith("/call/");
  }
}
