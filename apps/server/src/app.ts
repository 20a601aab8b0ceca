import type { KeyIdentity, RateLimitState, Store } from "@arbor/store";
import { ADAPTER_MAX_BYTES, DATASET_MAX_BYTES } from "@arbor/training";
import express, { type Express, type NextFunction, type Request, type Response } from "express";
import * as OpenApiValidator from "express-openapi-validator";
import type { Logger } from "pino";
import type { AppConfig, Role } from "./config.ts";
import { type Authenticate, authentication } from "./http/auth.ts";
import { jsonBody } from "./http/body.ts";
import { ApiError, errorHandler } from "./http/errors.ts";
import { type OpenApiDocument, specOperations } from "./http/openapi.ts";
import type { Handlers } from "./http/operations.ts";
import { RateLimiter, rateLimited } from "./http/rate-limit.ts";
import { requestId } from "./http/request-id.ts";
import { mountOperations, pendingOperations, tagOperations } from "./http/routes.ts";
import { securityHeaders } from "./http/security-headers.ts";
import { multipartBlocks, UploadBudget, uploadAdmission } from "./http/uploads.ts";
import type { Principal } from "./modules/access.ts";
import { baseModelsHandlers } from "./modules/base-models/routes.ts";
import { withItemsValidatedSeparately } from "./modules/calls/items.ts";
import { callsHandlers } from "./modules/calls/routes.ts";
import { consoleRoutes } from "./modules/console/routes.ts";
import { datasetsHandlers } from "./modules/datasets/routes.ts";
import { DATASET_MEDIA_TYPES } from "./modules/datasets/service.ts";
import { publicDocuments } from "./modules/docs/routes.ts";
import { healthHandlers } from "./modules/health/routes.ts";
import type { Probes } from "./modules/health/service.ts";
import { EngineChatBackend } from "./modules/inference/engine-chat.ts";
import type { EngineHost } from "./modules/inference/engines.ts";
import { llamaChatBackend } from "./modules/inference/llama-chat.ts";
import { ModelDirectory } from "./modules/inference/models.ts";
import { inferenceHandlers } from "./modules/inference/routes.ts";
import { ChatService } from "./modules/inference/service.ts";
import { UpstreamChatBackend } from "./modules/inference/upstream.ts";
import type { UpstreamAdapters } from "./modules/inference/upstream-lora.ts";
import type { Metrics } from "./modules/metrics/metrics.ts";
import { metricsEndpoint, requestMetrics } from "./modules/metrics/routes.ts";
import { modelsHandlers } from "./modules/models/routes.ts";
import { trainingHandlers } from "./modules/training/routes.ts";

type ValidatorSpec = Exclude<Parameters<typeof OpenApiValidator.middleware>[0]["apiSpec"], string>;

export interface AppDeps {
  config: AppConfig;
  logger: Logger;
  spec: OpenApiDocument;
  store: Store;
  engines: EngineHost;
  probes: Probes;
  /** The process's metrics, served at `/metrics` (the training worker reports into them too). */
  metrics: Metrics;
  /** Where rate limits are counted (shared by replicas on PostgreSQL or Redis); default: in
   * this process. */
  rateLimits?: RateLimitState;
  /** Called when a training job was queued, so an idle worker looks at once. */
  onJobQueued?: () => void;
  /** Called when a job was cancelled, so the worker running it in this process stops now. */
  onJobCancelled?: (jobId: string) => void;
  /** The adapters of checkpoints that upstreams serve (their folders are swept with the rest
   * of what a crash leaves, by the server). */
  upstreamAdapters: UpstreamAdapters;
}

/** Builds the app from its dependencies. It never listens: `main.ts` does, tests use port 0. */
export function createApp(deps: AppDeps): Express {
  const { config, logger, spec } = deps;
  const app = express();
  app.disable("x-powered-by");
  app.set("query parser", "extended");

  const authenticate: Authenticate = async (token) =>
    principalOf(await deps.store.apiKeys.verify(token));
  app.use(requestId);
  app.use(securityHeaders());
  app.use(accessLog(logger));
  app.use(requestMetrics(deps.metrics));
  app.use(publicDocuments(spec));
  app.use(consoleRoutes());
  // Every role serves it: each process counts its own requests, chats and jobs.
  app.use(
    metricsEndpoint({
      access: config.metrics,
      metrics: deps.metrics,
      authenticate,
    }),
  );
  app.use(rawModelIdInPath);
  // Roles: a deployment may serve only some surfaces; the others' paths answer 404 here.
  const operations = specOperations(spec).filter((op) =>
    config.roles.some((role) => servesPath(role, op.path)),
  );
  app.use(tagOperations(operations));
  const publicPaths = new Set(operations.filter((op) => op.public).map((op) => op.path));
  app.use(authentication(authenticate, publicPaths));
  app.use(
    "/v1/chat/completions",
    rateLimited(
      new RateLimiter(config.rateLimits, {
        ...(deps.rateLimits ? { state: deps.rateLimits } : {}),
        onError: (err) => logger.warn({ err }, "rate limits: their state could not be reached"),
      }),
      (scope, limit) => deps.metrics.rateLimited(scope, limit),
    ),
  );
  app.use("/v1/chat/completions", jsonBody(10 * 1024 * 1024));
  app.use(
    "/v1/preview/datasets",
    express.text({ type: DATASET_MEDIA_TYPES, limit: DATASET_MAX_BYTES }),
  );
  // Adapter uploads take their share of the upload budget before anything reads their body;
  // a tar is then read as it arrives by the handler (multipart parts by the validator's multer).
  app.use(uploadAdmission(new UploadBudget(config.uploadMemoryBytes)));
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
        // multipart/form-data bodies (adapter uploads, the only ones): in memory, capped, kept
        // in blocks that the adapter check's thread joins.
        fileUploader: {
          storage: multipartBlocks,
          limits: { fileSize: ADAPTER_MAX_BYTES, files: 2, fields: 0 },
        },
        $refParser: { mode: "dereference" },
      }),
    );
  }

  const directory = new ModelDirectory(deps.engines, deps.store, config.upstreams);
  const { upstreamAdapters } = deps;
  const handlers: Handlers = {
    ...healthHandlers(deps.probes),
    ...callsHandlers(deps.store),
    ...modelsHandlers({
      store: deps.store,
      baseModels: async () => (await deps.engines.current()).map((m) => m.id),
      baseModel: (id) => deps.engines.find(id),
      checkpointsDeleted: (model, blobKeys) => upstreamAdapters.deleted(model.base_model, blobKeys),
    }),
    ...trainingHandlers({
      store: deps.store,
      ...(deps.onJobQueued ? { onJobQueued: deps.onJobQueued } : {}),
      ...(deps.onJobCancelled ? { onJobCancelled: deps.onJobCancelled } : {}),
    }),
    ...datasetsHandlers(deps.store),
    ...baseModelsHandlers({
      modelsDir: deps.engines.modelsDir,
      weights: deps.engines.weights,
      hub: config.hub,
      refresh: () => deps.engines.refresh(),
      logger,
    }),
    ...inferenceHandlers({
      directory,
      chat: new ChatService({
        directory,
        backends: {
          engine: new EngineChatBackend(deps.engines, deps.store.blobs),
          llama: llamaChatBackend,
          upstream: new UpstreamChatBackend(upstreamAdapters),
        },
        calls: deps.store.calls,
        logger,
        observer: deps.metrics.chat,
      }),
    }),
  };
  app.use(mountOperations(operations, handlers));
  // The operations answering 501 until their issue lands; the contract tests compare it.
  app.locals.pendingOperations = pendingOperations(operations, handlers);
  app.use((_req: Request, _res: Response, next: NextFunction) =>
    next(ApiError.notFound("Unknown path.")),
  );
  app.use(errorHandler(logger));
  return app;
}

/** Model ids contain `/`: `GET /v1/models/acme/proj/name` (as typed with curl) is the same as the
 * percent-encoded form the `openai` clients send. */
function rawModelIdInPath(req: Request, _res: Response, next: NextFunction): void {
  const prefix = "/v1/models/";
  if (req.url.startsWith(prefix)) {
    const [path, query] = req.url.slice(prefix.length).split("?", 2) as [
      string,
      string | undefined,
    ];
    if (path.includes("/")) {
      let id: string;
      try {
        id = decodeURIComponent(path);
      } catch {
        next(
          ApiError.badRequest(
            "The model id in the path is not valid percent-encoding.",
            "model",
            "invalid_path",
          ),
        );
        return;
      }
      req.url = `${prefix}${encodeURIComponent(id)}${query ? `?${query}` : ""}`;
      // The validator matches on originalUrl.
      req.originalUrl = req.url;
    }
  }
  next();
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
  const chat = path.startsWith("/v1/chat/completions");
  switch (role) {
    case "training":
      return chat || path.startsWith("/v1/preview/") || path.startsWith("/v1/training/");
    case "inference":
      return chat || path.startsWith("/v1/models");
    case "calls":
      return path.startsWith("/calls") || path.startsWith("/call/");
  }
}
