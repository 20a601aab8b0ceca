import type { RateLimitState, Store } from "@arbor/store";
import type { Express } from "express";
import type { Logger } from "pino";
import type { AppConfig } from "../config.ts";
import type { Authenticate } from "../http/auth.ts";
import type { OpenApiDocument } from "../http/openapi.ts";
import type { Handlers } from "../http/operations.ts";
import type { Probes } from "./health/service.ts";
import type { EngineHost } from "./inference/engines.ts";
import type { UpstreamAdapters } from "./inference/upstream-lora.ts";
import type { Metrics } from "./metrics/metrics.ts";

/** What the app is built from (`createApp`), and what its modules are given. */
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

/** What each module is given: the app's dependencies, and what the app built once over them. */
export interface ModuleDeps extends AppDeps {
  /** The principal of a presented key, as `authentication` finds it. */
  authenticate: Authenticate;
}

/**
 * A feature module (`modules/<name>/module.ts`): what it adds to the app, at each stage of the
 * app's middleware where it has something (ADR 54). `createApp` builds what every request goes
 * through (request id, security headers, logs, authentication, the shared JSON parser, the
 * validator, the error handler) and runs each stage for its modules in the order of their list,
 * so the middleware's order is the app's, and a module's parsers, limiters and wiring are its own.
 */
export interface ServerModule {
  /** Named in the error when two modules claim one operation (`moduleHandlers`). */
  readonly name: string;
  /** Before authentication: what it serves outside the spec (documents, the console,
   * `/metrics`), and rewrites of its paths before they are matched. */
  beforeAuthentication?(app: Express, deps: ModuleDeps): void;
  /** After authentication, before the shared JSON parser and the validator: its paths'
   * limiters and body parsers (a body read here is not read again). */
  beforeValidation?(app: Express, deps: ModuleDeps): void;
  /** Its operations' handlers, by operationId; the app mounts one route per operation. */
  handlers?(deps: ModuleDeps): Handlers;
}

/** The handlers of all the modules, by operationId. Each operation is one module's: a second
 * module handling it is an error, not a silent replacement. */
export function moduleHandlers(modules: readonly ServerModule[], deps: ModuleDeps): Handlers {
  const handlers: Handlers = {};
  const owners = new Map<string, string>();
  for (const module of modules) {
    const own = module.handlers?.(deps) ?? {};
    for (const operationId of Object.keys(own)) {
      const owner = owners.get(operationId);
      if (owner !== undefined) {
        throw new Error(`${owner} and ${module.name} both handle ${operationId}`);
      }
      owners.set(operationId, module.name);
    }
    Object.assign(handlers, own);
  }
  return handlers;
}
