export { type AppDeps, createApp } from "./app.ts";
export { ADMIN_ENTITY, ADMIN_KEY_FILE, ADMIN_USER, ensureFirstAdmin } from "./bootstrap.ts";
export { type AppConfig, defaultAppConfig } from "./config.ts";
export { loadSpec, type OpenApiDocument, specOperations } from "./http/openapi.ts";
export { engineProbe, storeProbes } from "./modules/health/probes.ts";
export { type Probes, timed } from "./modules/health/service.ts";
export { EngineHost } from "./modules/inference/engines.ts";
export { LlamaCppBackend } from "./modules/inference/llama-cpp.ts";
export { serve } from "./serve.ts";
