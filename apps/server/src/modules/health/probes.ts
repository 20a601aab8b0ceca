import type { Role } from "@arbor/config";
import type { RateLimitState, Store } from "@arbor/store";
import type { WorkerHealth } from "@arbor/training";
import type { EngineHost } from "../inference/engines.ts";
import { type Probe, type Probes, timed } from "./service.ts";

/** Real checks of what `roles` use: a database round trip (every role: keys live there), the
 * queue's depth (`training`), the engine's catalogue (the roles that serve chat). */
export function storeProbes(
  store: Store,
  engine: NonNullable<Probes["engine"]>,
  roles: readonly Role[],
): Probes {
  const serves = (role: Role) => roles.includes(role);
  return {
    roles,
    database: async () => ({ ...(await store.ping()) }),
    ...(serves("training")
      ? {
          queue: () =>
            timed(async () => {
              const depth = await store.jobs.depth();
              return { depth: depth.queued };
            }),
        }
      : {}),
    ...(serves("training") || serves("inference") ? { engine } : {}),
  };
}

/** The Redis that keeps the rate limits: a PING. */
export function redisProbe(state: RateLimitState): Probe {
  return () =>
    timed(async () => {
      await state.ping();
      return {};
    });
}

/** The embedded training worker: every training thread alive. */
export function workerProbe(health: () => WorkerHealth): Probe {
  return async () => {
    const { success, error, threads, running } = health();
    return { success, duration: 0, error, threads, running };
  };
}

/** The engine serves: the shipped models load (the first probe pays for loading; folders a user
 * added are checked when scanned, and loaded on first use). Folders that cannot be served are
 * listed with why, and do not fail the check: the others are served. */
export function engineProbe(engines: EngineHost): NonNullable<Probes["engine"]> {
  return () =>
    timed(async () => {
      const models = await engines.current();
      await Promise.all(models.filter((m) => m.shipped).map((m) => engines.engine(m.id)));
      return {
        models: models.length,
        skipped: engines.skipped.map(({ id, reason }) => ({ id, reason })),
      };
    });
}
