import type { NextFunction, Request, Response } from "express";
import { jsonBody } from "../../http/body.ts";
import { ApiError } from "../../http/errors.ts";
import { RateLimiter, rateLimited } from "../../http/rate-limit.ts";
import type { ServerModule } from "../module.ts";
import { EngineChatBackend } from "./engine-chat.ts";
import { llamaChatBackend } from "./llama-chat.ts";
import { ModelDirectory } from "./models.ts";
import { inferenceHandlers } from "./routes.ts";
import { ChatService } from "./service.ts";
import { UpstreamChatBackend } from "./upstream.ts";

/** Chat completions, limited per key and project, on the engine, llama.cpp or an upstream; and
 * the models they serve. */
export const inferenceModule: ServerModule = {
  name: "inference",
  beforeAuthentication(app) {
    app.use(rawModelIdInPath);
  },
  beforeValidation(app, { config, logger, metrics, rateLimits }) {
    // OpenAI paths with no counterpart here: say what is served instead (ADR 65).
    for (const [path, message] of Object.entries(NOT_SERVED)) {
      app.use(path, (_req: Request, _res: Response, next: NextFunction) =>
        next(ApiError.notFound(message, "unknown_url")),
      );
    }
    // The Responses API runs over the chat path: the same limits and body cap.
    const paths = ["/v1/chat/completions", "/v1/responses"];
    app.use(
      paths,
      rateLimited(
        new RateLimiter(config.rateLimits, {
          ...(rateLimits ? { state: rateLimits } : {}),
          onError: (err) => logger.warn({ err }, "rate limits: their state could not be reached"),
        }),
        (scope, limit) => metrics.rateLimited(scope, limit),
      ),
    );
    app.use(paths, jsonBody(10 * 1024 * 1024));
  },
  handlers({ config, logger, store, engines, metrics, upstreamAdapters }) {
    const directory = new ModelDirectory(engines, store, config.upstreams);
    return inferenceHandlers({
      directory,
      chat: new ChatService({
        directory,
        backends: {
          engine: new EngineChatBackend(engines, store.blobs),
          llama: llamaChatBackend,
          upstream: new UpstreamChatBackend(upstreamAdapters),
        },
        calls: store.calls,
        logger,
        observer: metrics.chat,
      }),
    });
  },
};

/** OpenAI's paths that Arbor does not serve, and what to use instead. */
const NOT_SERVED: Record<string, string> = {
  "/v1/completions":
    "The legacy completions API (`/v1/completions`) is not served: use `/v1/chat/completions` or `/v1/responses`.",
  "/v1/embeddings":
    "Embeddings (`/v1/embeddings`) are not served: Arbor serves chat models only, none that embeds.",
};

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
