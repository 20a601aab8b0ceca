/** A training worker's settings, as the server's embedded worker and worker processes read them. */
export interface WorkerSettings {
  /** How long a claim on a job lasts without renewal (ARBOR_WORKER_LEASE_MS, default 15 s). */
  leaseMs: number;
  /** Largest `https://` training file fetched (ARBOR_TRAINING_DATA_MAX_BYTES, default 64 MiB). */
  maxTrainingDataBytes: number;
  /** Hosts a training URL may name even if they resolve to private addresses (comma-separated). */
  allowHosts: string[];
}

/** ARBOR_WORKER_LEASE_MS, ARBOR_TRAINING_DATA_MAX_BYTES and ARBOR_TRAINING_DATA_ALLOW_HOSTS, checked. */
export function workerSettingsFromEnv(env: NodeJS.ProcessEnv = process.env): WorkerSettings {
  return {
    leaseMs: positive(env, "ARBOR_WORKER_LEASE_MS") ?? 15_000,
    maxTrainingDataBytes: positive(env, "ARBOR_TRAINING_DATA_MAX_BYTES") ?? 64 * 1024 * 1024,
    allowHosts: (env.ARBOR_TRAINING_DATA_ALLOW_HOSTS ?? "")
      .split(",")
      .map((h) => h.trim())
      .filter(Boolean),
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
