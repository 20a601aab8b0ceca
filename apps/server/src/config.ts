import {
  adminKeyPath,
  type Config,
  type MetricsAccess,
  type Role,
  type UpstreamConfig,
  upstreamLoraDir,
} from "@arbor/config";
import type { RateLimits } from "./http/rate-limit.ts";

export type { Role } from "@arbor/config";

/** What the app itself (`createApp`) needs of the configuration. */
export interface AppConfig {
  /** Which surfaces this process serves (`--role`, ADR 1); all three by default. */
  roles: readonly Role[];
  /** Validate every JSON response against the spec (on by default; a bench turns it off). */
  validateResponses: boolean;
  /** Validate requests against the spec (on by default; a bench turns it off). */
  validateRequests: boolean;
  /** Limits on chat completions, per key and per project; unlimited by default. */
  rateLimits: RateLimits;
  /** Model ids served by OpenAI-compatible upstreams instead of the engine. */
  upstreams: Record<string, UpstreamConfig>;
  /** Where the adapters of checkpoints served by upstreams are written for them to read
   * (`ARBOR_UPSTREAM_LORA_DIR`). */
  upstreamLoraDir: string;
  /** Who may read `GET /metrics` (`ARBOR_METRICS`). */
  metrics: MetricsAccess;
  /** The Hugging Face Hub that base models are pulled from (`HF_ENDPOINT`, `HF_TOKEN`). */
  hub: { endpoint: string; token: string | undefined };
  /** Memory the adapter uploads in progress may hold together (`ARBOR_UPLOAD_MEMORY_BYTES`). */
  uploadMemoryBytes: number;
  /** The first admin key's file, for the console's sign-in page to name: set only when the
   * server listens on a loopback address, where whoever sees the page is on this machine
   * (ADR 67). */
  adminKeyPath?: string;
}

/** `127.0.0.1`, `::1`, `localhost`: only this machine reaches it. */
function isLoopback(host: string): boolean {
  return host === "localhost" || host === "::1" || /^127\.\d+\.\d+\.\d+$/.test(host);
}

/** The app's part of the configuration, requests and responses validated. */
export function appConfigOf(config: Config): AppConfig {
  return {
    roles: config.roles,
    validateRequests: true,
    validateResponses: true,
    upstreams: config.upstreams,
    upstreamLoraDir: upstreamLoraDir(config),
    metrics: config.metrics,
    hub: { endpoint: config.hfEndpoint, token: config.hfToken },
    uploadMemoryBytes: config.uploadMemoryBytes,
    ...(isLoopback(config.host) ? { adminKeyPath: adminKeyPath(config.dataDir) } : {}),
    rateLimits: {
      keyRequestsPerMinute: config.keyRequestsPerMinute,
      projectRequestsPerMinute: config.projectRequestsPerMinute,
      keyConcurrent: config.keyConcurrent,
      projectConcurrent: config.projectConcurrent,
    },
  };
}
