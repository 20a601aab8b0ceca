import { defaultKernelThreads } from "@arbor/engine";
import { storeOptionsFromEnv } from "@arbor/store";
import { workerSettingsFromEnv } from "@arbor/worker";
import type { RateLimits } from "./http/rate-limit.ts";
import { parseUpstreams, type Upstreams } from "./modules/inference/upstream.ts";

export type Role = "training" | "inference" | "calls";

export interface AppConfig {
  /** Which surfaces this process serves (CONTRACT §1); all three by default. */
  roles: readonly Role[];
  /** Validate every JSON response against the spec (on by default; a bench turns it off). */
  validateResponses: boolean;
  /** Validate requests against the spec (on by default; a bench turns it off). */
  validateRequests: boolean;
  /** Limits on chat completions, per key and per project; unlimited by default. */
  rateLimits: RateLimits;
  /** Model ids served by OpenAI-compatible upstreams instead of the engine. */
  upstreams: Upstreams;
}

export interface ServerConfig extends AppConfig {
  /** Run the training worker in this process (default); off when separate workers run. */
  embeddedWorker: boolean;
  /** Embedded training threads: jobs of that many models train side by side. Default 1. */
  trainingThreads: number;
  /** How long a worker's claim on a job lasts without renewal (a dead worker's job is
   * reclaimed after it). */
  workerLeaseMs: number;
  /** Largest `https://` training file fetched, in bytes. */
  maxTrainingDataBytes: number;
  /** Hosts an `https://` training URL may name even if they resolve to private addresses. */
  trainingDataAllowHosts: string[];
  host: string;
  port: number;
  dataDir: string;
  databaseUrl: string | undefined;
  /** PostgreSQL only: the schema to use (created when missing); default the search path's. */
  databaseSchema: string | undefined;
  logLevel: string;
  /** Threads of each embedded engine's kernels (ARBOR_ENGINE_THREADS; one per core by default). */
  engineThreads: number;
}

const allRoles: readonly Role[] = ["training", "inference", "calls"];

export function parseRoles(value: string | undefined): Role[] {
  if (!value) return [...allRoles];
  const roles = value.split(",").map((r) => r.trim());
  for (const role of roles) {
    if (!allRoles.includes(role as Role)) {
      throw new Error(`Unknown role "${role}"; expected some of ${allRoles.join(",")}`);
    }
  }
  return roles as Role[];
}

export function defaultAppConfig(overrides: Partial<AppConfig> = {}): AppConfig {
  return {
    roles: allRoles,
    validateResponses: true,
    validateRequests: true,
    rateLimits: {},
    upstreams: {},
    ...overrides,
  };
}

/** Configuration from the environment: ARBOR_PORT, ARBOR_HOST, ARBOR_DATA_DIR, DATABASE_URL,
 * ARBOR_DATABASE_SCHEMA, ARBOR_ROLES, ARBOR_LOG_LEVEL, and the chat limits ARBOR_KEY_RPM, ARBOR_PROJECT_RPM,
 * ARBOR_KEY_CONCURRENCY, ARBOR_PROJECT_CONCURRENCY, ARBOR_UPSTREAMS (JSON: model id →
 * {url, apiKey?, model?}), ARBOR_EMBEDDED_WORKER (on|off), ARBOR_WORKER_LEASE_MS, ARBOR_TRAINING_DATA_MAX_BYTES,
 * ARBOR_TRAINING_DATA_ALLOW_HOSTS (comma-separated) and ARBOR_ENGINE_THREADS (read by the engine
 * itself, in every thread; checked here so that a bad value fails at start). */
export function configFromEnv(env: NodeJS.ProcessEnv = process.env): ServerConfig {
  const port = Number(env.ARBOR_PORT ?? 8080);
  if (!Number.isInteger(port) || port < 0 || port > 65535) {
    throw new Error(`ARBOR_PORT must be a port number, got "${env.ARBOR_PORT}"`);
  }
  const store = storeOptionsFromEnv(env);
  const worker = workerSettingsFromEnv(env);
  return {
    ...defaultAppConfig(),
    roles: parseRoles(env.ARBOR_ROLES),
    host: env.ARBOR_HOST ?? "127.0.0.1",
    port,
    dataDir: store.dataDir,
    databaseUrl: store.databaseUrl,
    databaseSchema: store.schema,
    logLevel: env.ARBOR_LOG_LEVEL ?? "info",
    engineThreads: defaultKernelThreads(env),
    embeddedWorker: env.ARBOR_EMBEDDED_WORKER !== "off",
    trainingThreads: positive(env, "ARBOR_TRAINING_THREADS") ?? 1,
    workerLeaseMs: worker.leaseMs,
    maxTrainingDataBytes: worker.maxTrainingDataBytes,
    trainingDataAllowHosts: worker.allowHosts,
    upstreams: parseUpstreams(env.ARBOR_UPSTREAMS),
    rateLimits: {
      keyRequestsPerMinute: positive(env, "ARBOR_KEY_RPM"),
      projectRequestsPerMinute: positive(env, "ARBOR_PROJECT_RPM"),
      keyConcurrent: positive(env, "ARBOR_KEY_CONCURRENCY"),
      projectConcurrent: positive(env, "ARBOR_PROJECT_CONCURRENCY"),
    },
  };
}

function positive(env: NodeJS.ProcessEnv, name: string): number | undefined {
  const raw = env[name];
  if (raw === undefined || raw === "") return undefined;
  const value = Number(raw);
  if (!Number.isInteger(value) || value < 1)
    throw new Error(`${name} must be a positive integer, got "${raw}"`);
  return value;
}
