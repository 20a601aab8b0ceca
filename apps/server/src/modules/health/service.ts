import type { Role } from "@arbor/config";

/** One dependency check, as `/v1/system-check` reports it. */
export interface ProbeResult {
  success: boolean;
  /** Milliseconds the check took. */
  duration: number;
  error: string | null;
  [detail: string]: unknown;
}

export type Probe = () => Promise<ProbeResult>;

/** The dependencies `/v1/system-check` probes, each a real query or call: the ones this
 * process's roles use (ADR 43). */
export interface Probes {
  /** The roles served, reported with the probes. */
  roles: readonly Role[];
  database: Probe;
  /** The training queue: the `training` role. */
  queue?: Probe;
  /** The engine and upstreams: the roles that serve chat (`training`, `inference`). */
  engine?: Probe;
  /** The embedded training worker, when this process runs one. */
  worker?: Probe;
  /** The Redis that keeps the rate limits, when one is configured (`ARBOR_REDIS_URL`). */
  redis?: Probe;
}

/** Times `check` and turns a throw into a failed probe. */
export async function timed(
  check: () => Promise<Record<string, unknown> | undefined>,
): Promise<ProbeResult> {
  const start = performance.now();
  try {
    const detail = (await check()) ?? {};
    return { success: true, duration: round(performance.now() - start), error: null, ...detail };
  } catch (err) {
    const message = err instanceof Error ? err.message : String(err);
    return { success: false, duration: round(performance.now() - start), error: message };
  }
}

function round(ms: number): number {
  return Math.round(ms * 1000) / 1000;
}

export async function systemCheck(probes: Probes) {
  const [database, queue, engine, worker, redis] = await Promise.all([
    probes.database(),
    probes.queue?.(),
    probes.engine?.(),
    probes.worker?.(),
    probes.redis?.(),
  ]);
  const optional = { queue, engine, worker, redis };
  const present = Object.fromEntries(
    Object.entries(optional).filter((entry): entry is [string, ProbeResult] => !!entry[1]),
  );
  return {
    healthy: database.success && Object.values(present).every((probe) => probe.success),
    report: { api: true as const, roles: [...probes.roles], database, ...present },
  };
}
