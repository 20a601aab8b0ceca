/**
 * The server half of the validator bench (`validator.ts` spawns it, once per mode, so the load
 * generator and the server each get a core of their own).
 *
 * Usage: node bench/validator-server.ts <on|requests|off>
 *   on        the default config: requests and responses validated against the spec
 *   requests  requests validated, responses not
 *   off       neither
 *
 * Starts the real server (`buildServer`, through `startBenchServer`) on 127.0.0.1, port 0, with a SQLite store in a temp dir and the
 * first admin key, ingests one small trace (a root and four descendants with usage) through the
 * API, then prints one line of JSON on stdout: {"port", "apiKey", "projectId", "rootId"}.
 * It runs until stdin closes, its IPC channel (if any) closes, or it is sent SIGTERM/SIGINT, then
 * removes the temp dir.
 */
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createArborClient } from "@arbor/client";
import { startBenchServer } from "./server.ts";

export type ValidationMode = "on" | "requests" | "off";
export const validationModes: readonly ValidationMode[] = ["on", "requests", "off"];

/** What the server prints on stdout once it is ready. */
export interface BenchServerInfo {
  port: number;
  apiKey: string;
  projectId: string;
  rootId: string;
}

export const BENCH_PROJECT = "default/bench";
export const BENCH_ROOT = "bench-root";

const mode = process.argv[2] as ValidationMode;
if (!validationModes.includes(mode)) {
  process.stderr.write(`usage: node validator-server.ts <${validationModes.join("|")}>\n`);
  process.exit(2);
}

const dataDir = mkdtempSync(join(tmpdir(), "arbor-bench-"));
const server = await startBenchServer({
  dataDir,
  app: { validateRequests: mode !== "off", validateResponses: mode === "on" },
});
const { port, apiKey } = server;

// A small trace: root → a → a1, root → b → b1, every call with usage of one or two models.
const nodes: { id: string; parent: string | null; model: string; prompt: number }[] = [
  { id: BENCH_ROOT, parent: null, model: "m1", prompt: 10 },
  { id: "bench-a", parent: BENCH_ROOT, model: "m1", prompt: 20 },
  { id: "bench-a1", parent: "bench-a", model: "m2", prompt: 30 },
  { id: "bench-b", parent: BENCH_ROOT, model: "m2", prompt: 40 },
  { id: "bench-b1", parent: "bench-b", model: "m1", prompt: 50 },
];
const client = createArborClient({
  baseUrl: `http://127.0.0.1:${port}`,
  apiKey,
  maxRetries: 0,
});
await client.calls.upsertBatch({
  batch: [
    ...nodes.map((n, i) => ({
      mode: "start" as const,
      req: {
        start: {
          project_id: BENCH_PROJECT,
          id: n.id,
          trace_id: "bench-trace",
          parent_id: n.parent,
          op_name: "bench.op",
          started_at: `2026-11-01T00:00:0${i}Z`,
        },
      },
    })),
    ...nodes.map((n, i) => ({
      mode: "end" as const,
      req: {
        end: {
          project_id: BENCH_PROJECT,
          id: n.id,
          ended_at: `2026-11-01T00:01:0${i}Z`,
          summary: {
            usage: { [n.model]: { prompt_tokens: n.prompt, completion_tokens: n.prompt / 2 } },
          },
        },
      },
    })),
  ],
});

const info: BenchServerInfo = {
  port,
  apiKey,
  projectId: BENCH_PROJECT,
  rootId: BENCH_ROOT,
};
process.stdout.write(`${JSON.stringify(info)}\n`);

let closing = false;
async function shutdown(): Promise<void> {
  if (closing) return;
  closing = true;
  await server.close();
  rmSync(dataDir, { recursive: true, force: true });
  process.exit(0);
}
// With an IPC channel (validator.ts opens one), "cpu" asks for this process's CPU time so far:
// unlike requests/s, CPU time per request does not depend on what else the machine runs.
process.on("message", (message) => {
  if (message === "cpu") process.send?.({ cpu: process.cpuUsage() });
});
process.on("disconnect", shutdown);
process.on("SIGTERM", shutdown);
process.on("SIGINT", shutdown);
process.stdin.on("end", shutdown);
process.stdin.resume();
