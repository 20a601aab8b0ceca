export { type AppDeps, createApp } from "./app.ts";
export { type AppConfig, defaultAppConfig } from "./config.ts";
export { loadSpec, type OpenApiDocument, specOperations } from "./http/openapi.ts";
export { pendingOperations } from "./http/routes.ts";
export { type Probes, timed } from "./modules/health/service.ts";
