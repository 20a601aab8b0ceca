/**
 * What the OpenAPI validator (express-openapi-validator) costs: the same routes driven with
 * autocannon on loopback against a server with validation on (the default: requests and
 * responses), with requests only, and off.
 *
 * Usage: node bench/validator.ts [--rounds 10] [--duration 1] [--connections 10] [--warmup 3]
 *                                [--modes on,requests,off] [--cpu-prof DIR]
 *
 * Each mode gets its own server process (validator-server.ts), so the load generator and the
 * server do not share a core; all of them start first and stay up. For each server and route:
 * the first request's latency (cold: it includes whatever the validator compiles lazily), then a
 * warm-up run that is not counted. Then `rounds` rounds, each driving every mode in turn for
 * `duration` seconds (the order rotating), so that a burst of load from elsewhere on the machine
 * hits all modes alike: 10 × 1 s = 10 s per route and mode by default.
 *
 * Besides requests/s and latency, it reads each server's own CPU time (over IPC) and prints the
 * CPU time per request: on a busy machine that is the steadier measure of what validation adds.
 * Prints a markdown table and the validator's cost as a share of the throughput without it;
 * exits 1 if any measured request failed or was not 2xx, since the numbers would then be
 * meaningless. --cpu-prof DIR makes each server write a V8 CPU profile into DIR on exit.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { type EventEmitter, once } from "node:events";
import { readFileSync } from "node:fs";
import { cpus, loadavg } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import autocannon from "autocannon";
import type { BenchServerInfo, ValidationMode } from "./validator-server.ts";

const { values: args } = parseArgs({
  options: {
    duration: { type: "string", default: "1" },
    rounds: { type: "string", default: "10" },
    connections: { type: "string", default: "10" },
    warmup: { type: "string", default: "3" },
    modes: { type: "string", default: "on,requests,off" },
    "cpu-prof": { type: "string" },
  },
});
const duration = Number(args.duration);
const rounds = Number(args.rounds);
const connections = Number(args.connections);
const warmup = Number(args.warmup);
const modes = args.modes.split(",") as ValidationMode[];
const cpuProfDir = args["cpu-prof"];

/** The validator's cost is too high past this share of the throughput (the issue's bar). */
const MAX_COST = 1 / 3;

interface Route {
  name: string;
  method: "GET" | "POST";
  path: string;
  body?: (info: BenchServerInfo) => unknown;
  authorized: boolean;
}

const routes: Route[] = [
  {
    name: "POST /calls/usage",
    method: "POST",
    path: "/calls/usage",
    body: (info) => ({ project_id: info.projectId, call_ids: [info.rootId] }),
    authorized: true,
  },
  { name: "GET /v1/health", method: "GET", path: "/v1/health", authorized: false },
];

interface Server {
  mode: ValidationMode;
  child: ChildProcess;
  info: BenchServerInfo;
  /** Every request it answered under load, warm-ups included (to scale its CPU profile). */
  requests: number;
}

/** One mode on one route, pooled over the rounds. */
interface Tally {
  route: Route;
  mode: ValidationMode;
  firstMs: number;
  requests: number;
  seconds: number;
  cpuMs: number;
  failed: number;
  latencies: number[];
  /** Per round: requests/s and server CPU µs per request. */
  roundRps: number[];
  roundCpuUs: number[];
}

async function startServer(mode: ValidationMode): Promise<Server> {
  const nodeArgs = cpuProfDir
    ? ["--cpu-prof", "--cpu-prof-dir", cpuProfDir, "--cpu-prof-name", `server-${mode}.cpuprofile`]
    : [];
  const child = spawn(
    process.execPath,
    [...nodeArgs, new URL("./validator-server.ts", import.meta.url).pathname, mode],
    { stdio: ["pipe", "pipe", "inherit", "ipc"] },
  );
  let out = "";
  child.stdout!.setEncoding("utf8");
  const info = await new Promise<BenchServerInfo>((resolve, reject) => {
    child.once("exit", (code) => reject(new Error(`server (${mode}) exited with ${code}`)));
    child.stdout!.on("data", (chunk: string) => {
      out += chunk;
      const newline = out.indexOf("\n");
      if (newline >= 0) resolve(JSON.parse(out.slice(0, newline)) as BenchServerInfo);
    });
  });
  return { mode, child, info, requests: 0 };
}

async function stopServer(server: Server): Promise<void> {
  if (server.child.exitCode !== null) return;
  const exited = once(server.child, "exit");
  server.child.kill("SIGTERM");
  await exited;
}

/** The server's CPU time (user + system) so far, in ms. */
async function serverCpuMs(server: Server): Promise<number> {
  const reply = once(server.child, "message");
  server.child.send("cpu");
  const [message] = (await reply) as [{ cpu: NodeJS.CpuUsage }];
  return (message.cpu.user + message.cpu.system) / 1000;
}

function requestOf(route: Route, info: BenchServerInfo) {
  const headers: Record<string, string> = {};
  if (route.authorized) headers.authorization = `Bearer ${info.apiKey}`;
  if (route.body) headers["content-type"] = "application/json";
  return {
    url: `http://127.0.0.1:${info.port}${route.path}`,
    method: route.method,
    headers,
    body: route.body ? JSON.stringify(route.body(info)) : undefined,
  };
}

/** One request, its answer checked: its latency, cold. */
async function firstRequest(route: Route, info: BenchServerInfo): Promise<number> {
  const { url, ...init } = requestOf(route, info);
  const start = performance.now();
  const response = await fetch(url, init);
  const text = await response.text();
  const ms = performance.now() - start;
  if (!response.ok) {
    throw new Error(`${route.name} answered ${response.status}: ${text.slice(0, 500)}`);
  }
  if (route.path === "/calls/usage") {
    const body = JSON.parse(text) as { call_usage: Record<string, Record<string, unknown>> };
    const models = Object.keys(body.call_usage[info.rootId] ?? {}).sort();
    if (models.join() !== "m1,m2") {
      throw new Error(`the bench trace did not sum as expected: ${text.slice(0, 500)}`);
    }
  }
  return ms;
}

/** autocannon's own histogram keeps whole milliseconds; its response events carry the exact
 * latency, which the percentiles here are taken from. */
async function load(route: Route, server: Server, seconds: number, latencies: number[] = []) {
  const cpuBefore = await serverCpuMs(server);
  const result = await new Promise<autocannon.Result>((resolve, reject) => {
    const instance = autocannon(
      { ...requestOf(route, server.info), connections, duration: seconds },
      (err: Error | null, result: autocannon.Result) => (err ? reject(err) : resolve(result)),
    );
    // autocannon 8+ passes the client first; @types/autocannon (written for 7) leaves it out.
    (instance as unknown as EventEmitter).on(
      "response",
      (_client: unknown, statusCode: number, _bytes: number, ms: number) => {
        if (statusCode >= 200 && statusCode < 300) latencies.push(ms);
      },
    );
  });
  server.requests += result.requests.total;
  return {
    requests: result.requests.total,
    seconds: result.duration || seconds,
    cpuMs: (await serverCpuMs(server)) - cpuBefore,
    failed: result.errors + result.timeouts + result.non2xx,
  };
}

function percentile(sorted: number[], q: number): number {
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))] ?? Number.NaN;
}

const servers: Server[] = [];
const tallies: Tally[] = [];
const loadBefore = loadavg()[0]!;
try {
  for (const mode of modes) servers.push(await startServer(mode));
  for (const server of servers) {
    for (const route of routes) {
      const firstMs = await firstRequest(route, server.info);
      if (warmup > 0) await load(route, server, warmup);
      tallies.push({
        route,
        mode: server.mode,
        firstMs,
        requests: 0,
        seconds: 0,
        cpuMs: 0,
        failed: 0,
        latencies: [],
        roundRps: [],
        roundCpuUs: [],
      });
    }
  }
  for (let round = 1; round <= rounds; round++) {
    for (const route of routes) {
      // Each round starts with the next mode, so that no mode always follows another.
      const order = servers.map((_, i) => servers[(i + round) % servers.length]!);
      for (const server of order) {
        const tally = tallies.find((t) => t.route === route && t.mode === server.mode)!;
        const run = await load(route, server, duration, tally.latencies);
        tally.requests += run.requests;
        tally.seconds += run.seconds;
        tally.cpuMs += run.cpuMs;
        tally.failed += run.failed;
        tally.roundRps.push(run.requests / run.seconds);
        tally.roundCpuUs.push((1000 * run.cpuMs) / run.requests);
      }
    }
    process.stderr.write(`round ${round}/${rounds} done\n`);
  }
} finally {
  await Promise.all(servers.map(stopServer));
}
const loadAfter = loadavg()[0]!;

const median = (values: number[]) =>
  percentile(
    [...values].sort((x, y) => x - y),
    0.5,
  );
const rows = tallies.map((t) => {
  const sorted = t.latencies.sort((a, b) => a - b);
  return {
    ...t,
    rps: median(t.roundRps),
    p50: percentile(sorted, 0.5),
    p99: percentile(sorted, 0.99),
    cpuUs: median(t.roundCpuUs),
  };
});

const fixed = (n: number, digits = 0) => n.toFixed(digits);
const percent = (share: number) => `${fixed(share * 100, 1)} %`;
const cpu = cpus();
const lines = [
  `Validator bench, ${new Date().toISOString().slice(0, 10)}: ${rounds} rounds of ${duration} s ` +
    `per route and mode (after ${warmup} s of warm-up), ${connections} connections, Node ` +
    `${process.version}, ${cpu.length} × ${cpu[0]?.model ?? "CPU"}, load average ` +
    `${fixed(loadBefore, 1)} before, ${fixed(loadAfter, 1)} after${cpuProfDir ? ", CPU-profiled" : ""}`,
  "",
  "| route | validation | requests/s | p50 ms | p99 ms | server CPU µs/request | first request ms | errors/non-2xx |",
  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
  ...rows.map(
    (r) =>
      `| ${r.route.name} | ${r.mode} | ${fixed(r.rps)} | ${fixed(r.p50, 2)} | ${fixed(r.p99, 2)} ` +
      `| ${fixed(r.cpuUs)} | ${fixed(r.firstMs, 1)} | ${r.failed} |`,
  ),
  "",
  "requests/s and CPU µs/request: the median of the rounds; latencies: all rounds pooled.",
  "The validator's cost, as the share of the throughput with validation off that it takes, by",
  "requests/s and by the server's CPU time per request (a saturated single-threaded server's",
  "throughput is 1 / CPU per request, and CPU time is less disturbed by other load):",
  "",
];
let tooCostly = false;
for (const route of routes) {
  const off = rows.find((r) => r.route === route && r.mode === "off");
  if (!off) continue;
  for (const r of rows.filter((r) => r.route === route && r.mode !== "off")) {
    const byRps = 1 - r.rps / off.rps;
    const byCpu = 1 - off.cpuUs / r.cpuUs;
    const over = byRps > MAX_COST;
    if (over) tooCostly = true;
    lines.push(
      `- ${route.name}, validation ${r.mode}: ${percent(byRps)} by requests/s, ` +
        `${percent(byCpu)} by CPU per request${over ? ": over the bar of a third" : ""}`,
    );
  }
}

if (cpuProfDir) {
  lines.push(
    "",
    "Where the servers' CPU went (V8 CPU profiles, whole run; each sample goes to the nearest",
    "enclosing frame of express-openapi-validator or ajv, or else of any other package):",
    "",
    "| validation | validator % of busy CPU | validator µs/request | top validator frames (self) |",
    "| --- | ---: | ---: | --- |",
  );
  for (const server of servers) {
    const file = join(cpuProfDir, `server-${server.mode}.cpuprofile`);
    const profile = attribute(JSON.parse(readFileSync(file, "utf8")) as CpuProfile);
    const top = profile.frames
      .slice(0, 4)
      .map(([frame, us]) => `${frame} ${percent(us / profile.busyUs)}`)
      .join(", ");
    lines.push(
      `| ${server.mode} | ${percent(profile.validatorUs / profile.busyUs)} | ` +
        `${fixed(profile.validatorUs / server.requests, 1)} | ${top} |`,
    );
  }
}
process.stdout.write(`${lines.join("\n")}\n`);

const failures = rows.reduce((sum, r) => sum + r.failed, 0);
if (failures > 0) {
  process.stderr.write(
    `${failures} requests failed or were not 2xx: these numbers measure errors, not the routes\n`,
  );
  process.exit(1);
}
if (tooCostly) process.stderr.write("the validator costs more than a third of the throughput\n");

interface CpuProfile {
  nodes: {
    id: number;
    callFrame: { functionName: string; url: string; lineNumber: number };
    children?: number[];
  }[];
  samples: number[];
  timeDeltas: number[];
}

/** The validator's share of a V8 CPU profile. A sample belongs to the validator when the nearest
 * enclosing frame that is not Node's own, nor path-to-regexp (which both the validator and the
 * router call), is express-openapi-validator's or ajv's; `next()` into later middleware thus
 * stops counting as the validator's. */
function attribute(profile: CpuProfile) {
  const validatorUrl =
    /express-openapi-validator|\/ajv@|ajv-formats|media-typer|json-schema-traverse/;
  const neutralUrl = /^$|^node:|path-to-regexp|content-type@/;
  const nodes = new Map(profile.nodes.map((n) => [n.id, n]));
  const parents = new Map<number, number>();
  for (const n of profile.nodes) for (const child of n.children ?? []) parents.set(child, n.id);
  let busyUs = 0;
  let validatorUs = 0;
  const frames = new Map<string, number>();
  profile.samples.forEach((sample, i) => {
    const us = profile.timeDeltas[i] ?? 0;
    const leaf = nodes.get(sample)!;
    if (leaf.callFrame.functionName === "(idle)") return;
    busyUs += us;
    let id: number | undefined = sample;
    while (id !== undefined) {
      const { url } = nodes.get(id)!.callFrame;
      if (validatorUrl.test(url)) {
        validatorUs += us;
        const { functionName, url: leafUrl, lineNumber } = leaf.callFrame;
        const where = leafUrl.replace(/^.*node_modules\//, "").replace(/^.*\/dist\//, "");
        const frame = `${functionName || "(anonymous)"} (${where || "native"}${leafUrl ? `:${lineNumber + 1}` : ""})`;
        frames.set(frame, (frames.get(frame) ?? 0) + us);
        return;
      }
      if (!neutralUrl.test(url)) return;
      id = parents.get(id);
    }
  });
  return { busyUs, validatorUs, frames: [...frames].sort((a, b) => b[1] - a[1]) };
}
