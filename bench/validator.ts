/**
 * What the OpenAPI validator (express-openapi-validator) costs: the same routes driven with
 * autocannon on loopback against a server with validation on (the default: requests and
 * responses), with requests only, and off.
 *
 * Usage: node bench/validator.ts [--duration 10] [--connections 10] [--warmup 3]
 *                                [--modes on,requests,off] [--cpu-prof DIR]
 *
 * Each mode gets its own server process (validator-server.ts), so the load generator and the
 * server do not share a core. For each route: the first request's latency (cold: it includes
 * whatever the validator compiles lazily), a warm-up run that is not counted, then the measured
 * run. Prints a markdown table and the validator's cost as a share of the throughput without it;
 * exits 1 if any measured request failed or was not 2xx, since the numbers would then be
 * meaningless. --cpu-prof DIR makes each server write a V8 CPU profile into DIR on exit.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
import { cpus } from "node:os";
import { parseArgs } from "node:util";
import autocannon from "autocannon";
import type { BenchServerInfo, ValidationMode } from "./validator-server.ts";

const { values: args } = parseArgs({
  options: {
    duration: { type: "string", default: "10" },
    connections: { type: "string", default: "10" },
    warmup: { type: "string", default: "3" },
    modes: { type: "string", default: "on,requests,off" },
    "cpu-prof": { type: "string" },
  },
});
const duration = Number(args.duration);
const connections = Number(args.connections);
const warmup = Number(args.warmup);
const modes = args.modes.split(",") as ValidationMode[];
const cpuProfDir = args["cpu-prof"];

/** The validator's cost is too high past this share of the throughput (the bar). */
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

interface Row {
  route: string;
  mode: ValidationMode;
  firstMs: number;
  rps: number;
  p50: number;
  p99: number;
  failed: number;
}

async function startServer(
  mode: ValidationMode,
): Promise<{ child: ChildProcess; info: BenchServerInfo }> {
  const nodeArgs = cpuProfDir
    ? ["--cpu-prof", "--cpu-prof-dir", cpuProfDir, "--cpu-prof-name", `server-${mode}.cpuprofile`]
    : [];
  const child = spawn(
    process.execPath,
    [...nodeArgs, new URL("./validator-server.ts", import.meta.url).pathname, mode],
    { stdio: ["pipe", "pipe", "inherit"] },
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
  return { child, info };
}

async function stopServer(child: ChildProcess): Promise<void> {
  const exited = once(child, "exit");
  child.kill("SIGTERM");
  await exited;
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

/** One request, checked: its latency, cold. */
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

async function load(route: Route, info: BenchServerInfo, seconds: number) {
  return autocannon({
    ...requestOf(route, info),
    connections,
    duration: seconds,
  });
}

const rows: Row[] = [];
let failures = 0;
for (const mode of modes) {
  const { child, info } = await startServer(mode);
  try {
    for (const route of routes) {
      const firstMs = await firstRequest(route, info);
      if (warmup > 0) await load(route, info, warmup);
      const result = await load(route, info, duration);
      const failed = result.errors + result.timeouts + result.non2xx;
      failures += failed;
      const row: Row = {
        route: route.name,
        mode,
        firstMs,
        rps: result.requests.average,
        p50: result.latency.p50,
        p99: result.latency.p99,
        failed,
      };
      rows.push(row);
      process.stderr.write(
        `${route.name} validation ${mode}: ${Math.round(row.rps)} req/s, p50 ${row.p50} ms, ` +
          `p99 ${row.p99} ms, failed ${failed}\n`,
      );
    }
  } finally {
    await stopServer(child);
  }
}

const fixed = (n: number, digits = 0) => n.toFixed(digits);
const lines = [
  `Validator bench: ${duration} s per run after ${warmup} s of warm-up, ${connections} connections, ` +
    `Node ${process.version}, ${cpus().length} × ${cpus()[0]?.model ?? "CPU"}`,
  "",
  "| route | validation | requests/s | p50 ms | p99 ms | first request ms | errors/non-2xx |",
  "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
  ...rows.map(
    (r) =>
      `| ${r.route} | ${r.mode} | ${fixed(r.rps)} | ${r.p50} | ${r.p99} | ${fixed(r.firstMs, 1)} | ${r.failed} |`,
  ),
  "",
];
let tooCostly = false;
for (const route of routes) {
  const off = rows.find((r) => r.route === route.name && r.mode === "off");
  if (!off) continue;
  for (const r of rows.filter((r) => r.route === route.name && r.mode !== "off")) {
    const cost = 1 - r.rps / off.rps;
    const over = cost > MAX_COST;
    if (over && route.path === "/calls/usage") tooCostly = true;
    lines.push(
      `- ${route.name}, validation ${r.mode}: the validator costs ${fixed(cost * 100, 1)} % of ` +
        `the throughput without it${over ? " (over the bar of a third)" : ""}`,
    );
  }
}
process.stdout.write(`${lines.join("\n")}\n`);

if (failures > 0) {
  process.stderr.write(
    `${failures} requests failed or were not 2xx: these numbers measure errors, not the routes\n`,
  );
  process.exit(1);
}
if (tooCostly) process.exitCode = 2;
