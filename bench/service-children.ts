/**
 * What the benches that run the service share: a child process of the bench's own script (the
 * server, a worker) that prints one JSON line when ready and stops on SIGTERM, the parent's client
 * of a server child, a training job followed to its end with its times, and the table a bench
 * prints.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
import { type ArborClient, createArborClient, type TrainingJobEvent } from "@arbor/client";
import { startBenchServer } from "./server.ts";

/** A child's clean stop: SIGTERM, SIGINT or its stdin closing (the parent gone) run `close`. */
export function onShutdown(close: () => Promise<void>): void {
  let closing = false;
  const shutdown = async () => {
    if (closing) return;
    closing = true;
    await close();
    process.exit(0);
  };
  process.on("SIGTERM", shutdown);
  process.on("SIGINT", shutdown);
  process.stdin.on("end", shutdown);
  process.stdin.resume();
}

/** The line a server child prints once it listens. */
export interface ServerInfo {
  port: number;
  apiKey: string;
}

/**
 * A server child: the real server (`startBenchServer(options)`), its {port, apiKey} printed once it
 * listens; on shutdown the server closes, then `onClose` runs.
 */
export async function serveBench(
  options: Parameters<typeof startBenchServer>[0],
  onClose?: () => void | Promise<void>,
): Promise<void> {
  const server = await startBenchServer(options);
  process.stdout.write(
    `${JSON.stringify({ port: server.port, apiKey: server.apiKey } satisfies ServerInfo)}\n`,
  );
  onShutdown(async () => {
    await server.close();
    await onClose?.();
  });
}

/** The parent's client of a server child, never retrying (a retried request would be timed). */
export function clientOf(info: ServerInfo): ArborClient {
  return createArborClient({
    baseUrl: `http://127.0.0.1:${info.port}`,
    apiKey: info.apiKey,
    maxRetries: 0,
  });
}

/** Starts `script` with `mode` and its spec (JSON) and waits for the first line it prints. */
export async function startChild<T>(
  script: string,
  mode: string,
  spec: object,
): Promise<{ child: ChildProcess; info: T; lines: string[] }> {
  const child = spawn(process.execPath, [script, mode, JSON.stringify(spec)], {
    stdio: ["pipe", "pipe", "inherit"],
  });
  let out = "";
  const lines: string[] = [];
  child.stdout!.setEncoding("utf8");
  child.stdout!.on("data", (chunk: string) => {
    out += chunk;
    for (let newline = out.indexOf("\n"); newline >= 0; newline = out.indexOf("\n")) {
      lines.push(out.slice(0, newline));
      out = out.slice(newline + 1);
      child.emit("line");
    }
  });
  const info = await new Promise<T>((resolve, reject) => {
    child.once("exit", (code) => reject(new Error(`child ${mode} exited with ${code}`)));
    child.once("line", () => resolve(JSON.parse(lines[0]!) as T));
  });
  return { child, info, lines };
}

export async function stopChild(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null) return;
  const exited = once(child, "exit");
  child.kill("SIGTERM");
  await exited;
}

/** The Unix ms in a UUID v7 (the store's job and event ids: 48-bit ms first). */
export function uuidMs(id: string): number {
  const uuid = /[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}/i.exec(id)?.[0];
  if (!uuid) throw new Error(`not a UUID v7: ${id}`);
  return Number.parseInt(uuid.replace(/-/g, "").slice(0, 12), 16);
}

/** A job's times, in ms. `*Arrival`: when the bench saw the event, from just before the create
 * call. `queue`, `training`: the server's own clock, from the UUID v7 of the job and of its
 * `training_started` and `training_ended` events (enqueued → started → ended). */
export interface JobTimes {
  startedArrival: number;
  endedArrival: number;
  queue: number;
  training: number;
}

/** Creates a job with `create` and follows it to its end, each event also to `onEvent`. */
export async function timedJob(
  client: ArborClient,
  create: () => Promise<{ id: string }>,
  onEvent?: (event: TrainingJobEvent) => void,
): Promise<JobTimes> {
  const t0 = performance.now();
  const job = await create();
  let startedArrival = Number.NaN;
  let endedArrival = Number.NaN;
  let startedAt = Number.NaN;
  let endedAt = Number.NaN;
  for await (const event of client.training.jobs.events.follow(job.id)) {
    const at = performance.now() - t0;
    onEvent?.(event);
    if (event.type === "training_started" && Number.isNaN(startedArrival)) {
      startedArrival = at;
      startedAt = uuidMs(event.id);
    }
    if (event.type === "training_ended") {
      endedArrival = at;
      endedAt = uuidMs(event.id);
    }
    if (event.type === "training_failed") {
      throw new Error(`job ${job.id} failed: ${String(event.data.error_message)}`);
    }
  }
  if (Number.isNaN(startedArrival) || Number.isNaN(endedArrival)) {
    throw new Error(`job ${job.id} ended without training_started/training_ended`);
  }
  return {
    startedArrival,
    endedArrival,
    queue: startedAt - uuidMs(job.id),
    training: endedAt - startedAt,
  };
}

export function median(values: number[]): number {
  const sorted = [...values].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  return sorted.length % 2 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2;
}

export function table(header: string[], rows: (string | number)[][]): string {
  const cells = [header, ...rows.map((r) => r.map(String))];
  const widths = header.map((_, i) => Math.max(3, ...cells.map((r) => r[i]!.length)));
  const right = header.map((_, i) => i > 0);
  const line = (r: string[]) =>
    `| ${r.map((c, i) => (right[i] ? c.padStart(widths[i]!) : c.padEnd(widths[i]!))).join(" | ")} |`;
  const rule = `| ${widths.map((w, i) => (right[i] ? `${"-".repeat(w - 1)}:` : "-".repeat(w))).join(" | ")} |`;
  return [line(header), rule, ...cells.slice(1).map(line)].join("\n");
}

export const sec = (ms: number) => (ms / 1000).toFixed(2);
