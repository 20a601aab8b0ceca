/**
 * Does one request freeze the server? `GET /v1/health` latency while hostile and heavy chat
 * requests arrive together.
 *
 * Usage: node bench/health-under-load.ts [--seconds 10]
 *
 * The real server (`apps/server/src/main.ts`, embedded defaults: SQLite in a temp dir, the
 * embedded training worker, validation on) runs in a child process on port 0. A poller, on its
 * own thread so the attack's client-side work does not delay it, sends `GET /v1/health` one
 * after another (a new request as soon as the last answered, at most one every 2 ms) through
 * three phases:
 *
 * 1. idle: nothing else;
 * 2. attack: three 9 MB prompts (words with spaces), one prompt of a 100,000-letter word and
 *    32 streaming chats (max_tokens 64) arrive together; once all have answered, the next
 *    such burst comes 100 ms later, until the phase ends. With `--sustained`, each of them is
 *    sent again as soon as it answers instead (a far heavier load: about 90 MB/s of bodies);
 * 3. after: nothing else again.
 *
 * Prints p50, p99 and max of the health latency per phase, and what the attack requests
 * answered. Target (ADR 28): p99 under 50 ms during the attack.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { cpus, loadavg, tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { Worker } from "node:worker_threads";

const { values: args } = parseArgs({
  options: {
    seconds: { type: "string", default: "10" },
    // One kind of attack alone, to see what costs what: big, word or streams.
    only: { type: "string" },
    sustained: { type: "boolean", default: false },
  },
});
const phaseMs = Number(args.seconds) * 1000;
const serverMain = fileURLToPath(new URL("../apps/server/src/main.ts", import.meta.url));

async function startServer(dataDir: string): Promise<{ child: ChildProcess; base: string }> {
  const child = spawn(
    process.execPath,
    [...(process.env.BENCH_NODE_ARGS ? process.env.BENCH_NODE_ARGS.split(" ") : []), serverMain],
    {
      env: { ...process.env, ARBOR_DATA_DIR: dataDir, ARBOR_PORT: "0", ARBOR_LOG_LEVEL: "info" },
      stdio: ["ignore", "pipe", "inherit"],
    },
  );
  const port = await new Promise<number>((resolve, reject) => {
    createInterface({ input: child.stdout! }).on("line", (line) => {
      try {
        const entry = JSON.parse(line) as { msg?: string; port?: number };
        if (entry.msg?.startsWith("Arbor listening") && entry.port) resolve(entry.port);
      } catch {
        // not a log line
      }
    });
    child.once("exit", (code) => reject(new Error(`the server exited with ${code}`)));
  });
  child.stdout!.resume();
  return { child, base: `http://127.0.0.1:${port}` };
}

function percentile(values: number[], q: number): number {
  if (values.length === 0) return Number.NaN;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))]!;
}

const dataDir = mkdtempSync(join(tmpdir(), "arbor-bench-health-"));
const { child, base } = await startServer(dataDir);
const key = readFileSync(join(dataDir, "admin.key"), "utf8").trim();
const headers = { authorization: `Bearer ${key}`, "content-type": "application/json" };

let phase: "idle" | "attack" | "after" | "done" = "idle";
const latencies: Record<string, number[]> = { idle: [], attack: [], after: [] };

/** The poller runs on its own thread: the attack's own work (encoding 9 MB bodies, reading 32
 * streams) must not delay the measuring. It reports each latency with the phase it began in. */
const POLLER = `
  const { parentPort, workerData } = require("node:worker_threads");
  let phase = "idle";
  parentPort.on("message", (p) => { phase = p; });
  (async () => {
    while (phase !== "done") {
      const current = phase;
      const start = performance.now();
      const response = await fetch(workerData + "/v1/health");
      await response.arrayBuffer();
      const ms = performance.now() - start;
      parentPort.postMessage([current, ms]);
      if (ms < 2) await new Promise((r) => setTimeout(r, 2 - ms));
    }
    parentPort.close();
  })();
`;
const poller = new Worker(POLLER, { eval: true, workerData: base });
poller.on("message", ([at, ms]: [string, number]) => latencies[at]?.push(ms));
const setPhase = (next: typeof phase) => {
  phase = next;
  poller.postMessage(next);
};

const chat = (content: string, extra: Record<string, unknown> = {}) =>
  JSON.stringify({
    model: "arbor/tiny-chat",
    messages: [{ role: "user", content }],
    max_tokens: 64,
    ...extra,
  });
const nineMb = chat("word ".repeat((9 * 1024 * 1024) / 5));
const longWord = chat("abcdefghij".repeat(10_000));
const outcomes = new Map<string, Map<number, number>>();

/** Sends `body` once; counts its status. */
async function send(name: string, body: string): Promise<void> {
  const counts = outcomes.get(name) ?? new Map<number, number>();
  outcomes.set(name, counts);
  const response = await fetch(`${base}/v1/chat/completions`, { method: "POST", headers, body });
  await response.arrayBuffer();
  counts.set(response.status, (counts.get(response.status) ?? 0) + 1);
}

/** Sends `body` again and again until the attack phase ends (`--sustained`). */
async function repeat(name: string, body: string): Promise<void> {
  while (phase === "attack") {
    await send(name, body);
    await new Promise((resolve) => setImmediate(resolve));
  }
}

// Warm-up: the validator compiles a route's schemas on its first request and each response
// status on its first answer; every kind of attack request is sent once before measuring.
for (const body of [chat("Hi"), chat("Hi", { stream: true }), nineMb, longWord]) {
  const response = await fetch(`${base}/v1/chat/completions`, { method: "POST", headers, body });
  await response.arrayBuffer();
  await (await fetch(`${base}/v1/health`)).arrayBuffer();
}
await new Promise((resolve) => setTimeout(resolve, phaseMs));
setPhase("attack");
const attacks: Record<string, [string, string][]> = {
  big: Array.from({ length: 3 }, () => ["9 MB prompt", nineMb] as [string, string]),
  word: [["100,000-letter word", longWord]],
  streams: Array.from({ length: 32 }, (_, i) => [
    "streaming chat",
    chat(`Count from 1 to ${i + 10}.`, { stream: true, seed: i }),
  ]),
};
const requests = Object.entries(attacks).flatMap(([name, list]) =>
  !args.only || args.only === name ? list : [],
);
async function bursts(): Promise<void> {
  while (phase === "attack") {
    await Promise.all(requests.map(([name, body]) => send(name, body)));
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}
const attackers = args.sustained ? requests.map(([name, body]) => repeat(name, body)) : [bursts()];
await new Promise((resolve) => setTimeout(resolve, phaseMs));
setPhase("after");
await Promise.all(attackers);
await new Promise((resolve) => setTimeout(resolve, phaseMs));
setPhase("done");
await new Promise((resolve) => poller.once("exit", resolve));
child.kill("SIGTERM");
await new Promise((resolve) => child.once("exit", resolve));
rmSync(dataDir, { recursive: true, force: true });

const round = (ms: number) => ms.toFixed(1);
console.log(
  `\n${cpus().length} × ${cpus()[0]?.model ?? "cpu"}, load ${loadavg()[0]!.toFixed(2)}; ${args.seconds} s per phase; ${args.sustained ? "sustained" : "bursts"}\n`,
);
console.log("| phase | health requests | p50 ms | p99 ms | max ms |");
console.log("|---|---:|---:|---:|---:|");
for (const [name, values] of Object.entries(latencies)) {
  console.log(
    `| ${name} | ${values.length} | ${round(percentile(values, 0.5))} | ${round(percentile(values, 0.99))} | ${round(Math.max(...values))} |`,
  );
}
console.log("\n| attack request | answers (status × count) |");
console.log("|---|---|");
for (const [name, counts] of outcomes) {
  console.log(`| ${name} | ${[...counts].map(([s, n]) => `${s} × ${n}`).join(", ")} |`);
}
