import { type ChildProcess, spawn } from "node:child_process";
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { type ArborClient, createArborClient } from "@arbor/client";

/** Real server and worker processes, for tests of crashes and of several workers. */
const require = createRequire(import.meta.url);
export const serverMain = join(dirname(require.resolve("@arbor/server")), "main.ts");
export const workerMain = fileURLToPath(
  new URL("../../../apps/worker/src/main.ts", import.meta.url),
);

export interface Child {
  process: ChildProcess;
  /** Every JSON log line the process has written so far. */
  logs: Record<string, unknown>[];
  kill9(): Promise<void>;
  /** SIGTERM, as a deploy stops a process; resolves with its exit code once it exited. */
  terminate(): Promise<number | null>;
}

/** Starts `main` and resolves once a log line whose `msg` starts with `ready` appears. */
export async function spawnLogged(
  main: string,
  env: Record<string, string>,
  ready: string,
): Promise<{ child: Child; entry: Record<string, unknown> }> {
  const proc = spawn(process.execPath, [main], {
    env: { ...process.env, ARBOR_LOG_LEVEL: "info", ...env },
    stdio: ["ignore", "pipe", "pipe"],
  });
  const logs: Record<string, unknown>[] = [];
  const entry = await new Promise<Record<string, unknown>>((resolve, reject) => {
    createInterface({ input: proc.stdout! }).on("line", (line) => {
      try {
        const parsed = JSON.parse(line) as Record<string, unknown>;
        logs.push(parsed);
        if (typeof parsed.msg === "string" && parsed.msg.startsWith(ready)) resolve(parsed);
      } catch {
        // not a log line
      }
    });
    proc.once("exit", (code) => reject(new Error(`${main} exited with ${code}`)));
  });
  const child: Child = {
    process: proc,
    logs,
    kill9: () =>
      new Promise((resolve) => {
        if (proc.exitCode !== null || proc.signalCode !== null) return resolve();
        proc.once("exit", () => resolve());
        proc.kill("SIGKILL");
      }),
    terminate: () =>
      new Promise((resolve) => {
        if (proc.exitCode !== null || proc.signalCode !== null) return resolve(proc.exitCode);
        proc.once("exit", (code) => resolve(code));
        proc.kill("SIGTERM");
      }),
  };
  return { child, entry };
}

/** A server process on port 0 over `dataDir`, and a client with `apiKey`, or else with the
 * first admin key it wrote there (only the first process on a store writes one). */
export async function startServerProcess(
  dataDir: string,
  env: Record<string, string> = {},
  apiKey: string = "",
): Promise<{ child: Child; client: ArborClient; port: number; apiKey: string }> {
  const { child, entry } = await spawnLogged(
    serverMain,
    { ARBOR_DATA_DIR: dataDir, ARBOR_PORT: "0", ...env },
    "Arbor listening",
  );
  apiKey ||= readFileSync(join(dataDir, "admin.key"), "utf8").trim();
  return {
    child,
    apiKey,
    port: entry.port as number,
    client: createArborClient({
      baseUrl: `http://127.0.0.1:${entry.port as number}`,
      apiKey,
      maxRetries: 0,
    }),
  };
}

/** The worker process (its logged `workerId`) whose training thread holds a lease: a worker's
 * threads hold leases as `<workerId>.<thread>#<boot>`. */
export function leaseWorker(owner: string): string {
  return owner.replace(/\.\d+#[0-9a-f]+$/, "");
}
