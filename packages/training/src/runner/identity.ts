import { randomUUID } from "node:crypto";
import { closeSync, mkdirSync, openSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { hostname } from "node:os";
import { join } from "node:path";

/**
 * A training worker's identity, stable across restarts where it can be, so that a restarted
 * worker reclaims the jobs its previous run held at once instead of waiting for their leases.
 */
export interface WorkerIdentity {
  /** Stable across restarts (or unique to this process when no stable one could be had). */
  stable: string;
  /** Whether `stable` outlives this process: only then are its earlier leases reclaimed. */
  persistent: boolean;
  /** Gives the identity back (removes the lock file). */
  release(): void;
}

/**
 * The embedded worker's identity: kept in the data directory, and locked there by this process
 * (a second live process on the same directory gets a throwaway identity rather than reclaiming
 * the first one's jobs).
 */
export function dataDirIdentity(dataDir: string): WorkerIdentity {
  mkdirSync(dataDir, { recursive: true });
  const idFile = join(dataDir, "worker-identity");
  let id: string;
  try {
    id = readFileSync(idFile, "utf8").trim();
  } catch {
    id = `embedded-${randomUUID()}`;
    writeFileSync(idFile, `${id}\n`);
  }
  const lock = join(dataDir, "worker-identity.lock");
  if (!takeLock(lock)) return processIdentity();
  return { stable: id, persistent: true, release: () => rmSync(lock, { force: true }) };
}

/** An identity for this process only (`ARBOR_WORKER_ID` gives a stable one instead). */
export function processIdentity(stable?: string): WorkerIdentity {
  if (stable) return { stable, persistent: true, release: () => {} };
  return {
    stable: `${hostname()}:${process.pid}:${randomUUID().slice(0, 8)}`,
    persistent: false,
    release: () => {},
  };
}

/** Creates `path` holding our pid; a lock left by a dead process is taken over. */
function takeLock(path: string): boolean {
  for (let attempt = 0; attempt < 2; attempt++) {
    try {
      const fd = openSync(path, "wx");
      writeFileSync(fd, String(process.pid));
      closeSync(fd);
      return true;
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== "EEXIST") throw err;
      const holder = Number(readFileSync(path, "utf8"));
      if (holder === process.pid) return true;
      if (alive(holder)) return false;
      rmSync(path, { force: true });
    }
  }
  return false;
}

function alive(pid: number): boolean {
  if (!Number.isInteger(pid) || pid <= 0) return false;
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === "EPERM";
  }
}
