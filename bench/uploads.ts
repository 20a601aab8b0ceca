/**
 * Does an adapter upload freeze the server or take its memory? `GET /v1/health` latency and the
 * server's peak RSS while hostile and heavy uploads arrive, one scenario at a time.
 *
 * Usage: node bench/uploads.ts [--only header,bomb,concurrent,valid]
 *
 * The real server (`apps/server/src/main.ts`, embedded defaults: SQLite in a temp dir, validation
 * on) runs in a child process on port 0. A poller on its own thread sends `GET /v1/health` one
 * after another (at most one every 2 ms) while each scenario runs:
 *
 * - header: a tar whose `adapter_model.safetensors` has a 100 MB header of 1.5 million entries;
 * - bomb: a gzipped tar that inflates to 1 GiB (one entry of zeros that the server skips);
 * - concurrent: four 255 MB tars at once, each a config and a safetensors file that does not fit
 *   the base;
 * - valid: four rank-256 BF16 adapters of arbor/tiny-chat at once (stored as F32).
 *
 * Each scenario runs on a fresh server. Prints, per scenario, the answers, the health requests
 * (how many, how many failed: reset or not 200; p50, p99 and max latency), the longest delay of
 * the server's event loop as it measures it (`arbor_nodejs_eventloop_lag_max_seconds` from
 * `/metrics`, read before and after: on a busy machine the health latency also counts waiting for
 * a core, this does not) and the server's peak RSS above its RSS before the scenario (Linux:
 * VmHWM, reset through /proc/<pid>/clear_refs).
 */
import { type ChildProcess, spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { cpus, loadavg, tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { Worker } from "node:worker_threads";
import { gzipSync } from "node:zlib";
import { adapterToFiles, createLoraAdapter, parseConfig } from "@arbor/engine/model";

const { values: args } = parseArgs({
  options: { only: { type: "string", default: "header,bomb,concurrent,valid" } },
});
const scenarios = args.only.split(",");
const serverMain = fileURLToPath(new URL("../apps/server/src/main.ts", import.meta.url));

async function startServer(
  dataDir: string,
): Promise<{ child: ChildProcess; base: string; pid: number }> {
  const child = spawn(process.execPath, [serverMain], {
    env: {
      ...process.env,
      ARBOR_DATA_DIR: dataDir,
      ARBOR_PORT: "0",
      ARBOR_LOG_LEVEL: "info",
      ARBOR_EMBEDDED_WORKER: "off",
    },
    stdio: ["ignore", "pipe", "ignore"],
  });
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
  return { child, base: `http://127.0.0.1:${port}`, pid: child.pid! };
}

function percentile(values: number[], q: number): number {
  if (values.length === 0) return Number.NaN;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))]!;
}

/** The child's resident set and its peak, in MB. */
function memory(pid: number): { rss: number; peak: number } {
  const status = readFileSync(`/proc/${pid}/status`, "utf8");
  const kb = (field: string) => Number(new RegExp(`${field}:\\s+(\\d+)`).exec(status)?.[1] ?? 0);
  return { rss: kb("VmRSS") / 1024, peak: kb("VmHWM") / 1024 };
}

/** A ustar header for a regular file of `size` bytes. */
function tarHeader(name: string, size: number): Buffer {
  const header = Buffer.alloc(512);
  const field = (offset: number, length: number, value: string) =>
    header.write(value, offset, length, "latin1");
  field(0, 100, name);
  field(100, 8, "0000644\0");
  field(108, 8, "0000000\0");
  field(116, 8, "0000000\0");
  field(124, 12, `${size.toString(8).padStart(11, "0")}\0`);
  field(136, 12, "00000000000\0");
  field(148, 8, "        ");
  field(156, 1, "0");
  field(257, 8, "ustar\u000000");
  let sum = 0;
  for (const byte of header) sum += byte;
  field(148, 8, `${sum.toString(8).padStart(6, "0")}\0 `);
  return header;
}

function tarOf(entries: { name: string; body: Uint8Array }[]): Buffer {
  const parts: Buffer[] = [];
  for (const { name, body } of entries) {
    parts.push(tarHeader(name, body.length), Buffer.from(body));
    parts.push(Buffer.alloc((512 - (body.length % 512)) % 512));
  }
  parts.push(Buffer.alloc(1024));
  return Buffer.concat(parts);
}

/** A safetensors file: `header` as its JSON, then `dataBytes` of zeros. */
function safetensors(header: string | Buffer, dataBytes: number): Buffer {
  const text = Buffer.from(header);
  const out = Buffer.alloc(8 + text.length + dataBytes);
  out.writeBigUInt64LE(BigInt(text.length), 0);
  text.copy(out, 8);
  return out;
}

const config = (r: number) =>
  Buffer.from(
    JSON.stringify({
      peft_type: "LORA",
      base_model_name_or_path: "arbor/tiny-chat",
      r,
      lora_alpha: 2 * r,
      target_modules: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    }),
  );

async function bodiesOf(scenario: string): Promise<{ body: Uint8Array; type: string }[]> {
  if (scenario === "header") {
    // 1.5 million one-value entries: 100 MB of header.
    const parts: string[] = ["{"];
    for (let i = 0; i < 1_500_000; i++)
      parts.push(`${i ? "," : ""}"t${i}":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}`);
    parts.push("}");
    const file = safetensors(parts.join(""), 4);
    const body = tarOf([
      { name: "adapter_config.json", body: config(8) },
      { name: "adapter_model.safetensors", body: file },
    ]);
    return [{ body, type: "application/x-tar" }];
  }
  if (scenario === "bomb") {
    // A tar entry of 1 GiB of zeros (a file the server skips, so it unzips on to its cap),
    // gzipped: one gzip member per 64 MiB.
    const size = 1024 * 1024 * 1024;
    const zeros = gzipSync(Buffer.alloc(64 * 1024 * 1024), { level: 9 });
    const members = [gzipSync(tarHeader("README.md", size))];
    for (let i = 0; i < size / (64 * 1024 * 1024); i++) members.push(zeros);
    return [{ body: Buffer.concat(members), type: "application/gzip" }];
  }
  if (scenario === "concurrent") {
    const name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    const bytes = 255 * 1024 * 1024 - 4096;
    const header = JSON.stringify({
      [name]: { dtype: "F32", shape: [bytes / 4], data_offsets: [0, bytes] },
    });
    const body = tarOf([
      { name: "adapter_config.json", body: config(8) },
      { name: "adapter_model.safetensors", body: safetensors(header, bytes) },
    ]);
    return Array.from({ length: 4 }, () => ({ body, type: "application/x-tar" }));
  }
  // small (the warm-up), or valid: a rank-256 adapter of tiny-chat in BF16, as PEFT often saves one (4.6 MB; stored as
  // F32, twice that).
  const tiny = parseConfig(
    JSON.parse(
      readFileSync(
        new URL("../packages/engine/models/tiny-chat/config.json", import.meta.url),
        "utf8",
      ),
    ),
  );
  const files = adapterToFiles(
    createLoraAdapter(
      { config: tiny },
      { rank: scenario === "small" ? 1 : 256, alpha: 16, baseModel: "arbor/tiny-chat" },
      1,
    ),
  );
  const body = tarOf([
    { name: "adapter_config.json", body: files["adapter_config.json"]! },
    { name: "adapter_model.safetensors", body: toBf16(files["adapter_model.safetensors"]!) },
  ]);
  return Array.from({ length: scenario === "small" ? 1 : 4 }, () => ({
    body,
    type: "application/x-tar",
  }));
}

/** An F32 safetensors file as BF16 (each value's upper half). */
function toBf16(f32: Uint8Array): Buffer {
  const bytes = Buffer.from(f32);
  const length = Number(bytes.readBigUInt64LE(0));
  const header = JSON.parse(bytes.subarray(8, 8 + length).toString()) as Record<
    string,
    { dtype: string; data_offsets: [number, number] }
  >;
  const base = 8 + length;
  const data: Buffer[] = [];
  for (const [name, entry] of Object.entries(header)) {
    if (name === "__metadata__") continue;
    const [start, end] = entry.data_offsets;
    const half = Buffer.alloc((end - start) / 2);
    for (let i = 0; i < half.length / 2; i++)
      half.writeUInt16LE(bytes.readUInt16LE(base + start + i * 4 + 2), i * 2);
    entry.dtype = "BF16";
    entry.data_offsets = [start / 2, end / 2];
    data.push(half);
  }
  return Buffer.concat([safetensors(JSON.stringify(header), 0), ...data]);
}

const POLLER = `
  const { parentPort, workerData } = require("node:worker_threads");
  let done = false;
  parentPort.on("message", () => { done = true; });
  (async () => {
    while (!done) {
      const start = performance.now();
      let failed = false;
      try {
        const response = await fetch(workerData + "/v1/health");
        await response.arrayBuffer();
        failed = response.status !== 200;
      } catch {
        failed = true;
      }
      const ms = performance.now() - start;
      parentPort.postMessage(failed ? -ms : ms);
      if (ms < 2) await new Promise((r) => setTimeout(r, 2 - ms));
    }
    parentPort.close();
  })();
`;

/** One scenario on a fresh server: its row of the table. */
async function run(scenario: string): Promise<string> {
  const dataDir = mkdtempSync(join(tmpdir(), "arbor-bench-uploads-"));
  const { child, base, pid } = await startServer(dataDir);
  try {
    const key = readFileSync(join(dataDir, "admin.key"), "utf8").trim();
    const auth = { authorization: `Bearer ${key}` };
    const newModel = async (name: string): Promise<string> => {
      const response = await fetch(`${base}/v1/preview/models`, {
        method: "POST",
        headers: { ...auth, "content-type": "application/json" },
        body: JSON.stringify({ project: "bench", name, base_model: "arbor/tiny-chat" }),
      });
      return ((await response.json()) as { id: string }).id;
    };
    /** The upload's status; 0 when the connection failed before an answer. */
    const upload = async (model: string, body: Uint8Array, type: string): Promise<number> => {
      try {
        const response = await fetch(`${base}/v1/preview/models/${model}/checkpoints`, {
          method: "POST",
          headers: { ...auth, "content-type": type },
          body,
        });
        await response.arrayBuffer();
        return response.status;
      } catch {
        return 0;
      }
    };
    /** The server's own measure of its event loop: the longest delay since the last scrape
     * (prom-client resets its histogram on each). */
    const loopDelayMs = async () => {
      const text = await (await fetch(`${base}/metrics`, { headers: auth })).text();
      const max = /^arbor_nodejs_eventloop_lag_max_seconds (\S+)$/m.exec(text)?.[1];
      return Number(max) * 1000;
    };
    // Warm-up: the validator compiles a route's schemas on its first request and each answer's
    // on its first answer; the adapter check's thread starts with the first upload.
    await upload(await newModel("warm-up"), Buffer.from("not a tar"), "application/x-tar");
    const small = (await bodiesOf("small"))[0]!;
    await upload(await newModel("warm-up-2"), small.body, small.type);
    await (await fetch(`${base}/v1/health`)).arrayBuffer();
    const bodies = await bodiesOf(scenario);
    const models = await Promise.all(bodies.map((_, i) => newModel(`${scenario}-${i}`)));
    await new Promise((resolve) => setTimeout(resolve, 500));
    writeFileSync(`/proc/${pid}/clear_refs`, "5");
    const before = memory(pid).rss;
    await loopDelayMs();
    const latencies: number[] = [];
    let failures = 0;
    const poller = new Worker(POLLER, { eval: true, workerData: base });
    poller.on("message", (ms: number) => {
      // A failed health request (reset, or not 200) counts with the time it took.
      if (ms < 0) failures++;
      latencies.push(Math.abs(ms));
    });
    const start = performance.now();
    const statuses = await Promise.all(bodies.map((b, i) => upload(models[i]!, b.body, b.type)));
    const seconds = (performance.now() - start) / 1000;
    poller.postMessage("done");
    await new Promise((resolve) => poller.once("exit", resolve));
    const peak = memory(pid).peak - before;
    const delay = await loopDelayMs();
    const counts = new Map<number, number>();
    for (const s of statuses) counts.set(s, (counts.get(s) ?? 0) + 1);
    const mb = (bodies[0]!.body.length / 1024 / 1024).toFixed(1);
    const ms = (q: number) => percentile(latencies, q).toFixed(1);
    return `| ${scenario} | ${bodies.length} × ${mb} MB | ${[...counts].map(([s, n]) => `${s} × ${n}`).join(", ")} | ${seconds.toFixed(2)} | ${latencies.length} | ${failures} | ${ms(0.5)} | ${ms(0.99)} | ${Math.max(...latencies).toFixed(1)} | ${delay.toFixed(1)} | ${Math.round(before)} | +${Math.round(peak)} |`;
  } finally {
    child.kill("SIGTERM");
    await new Promise((resolve) => child.once("exit", resolve));
    rmSync(dataDir, { recursive: true, force: true });
  }
}

const rows: string[] = [];
for (const scenario of scenarios) rows.push(await run(scenario));

console.log(
  `\n${cpus().length} × ${cpus()[0]?.model ?? "cpu"}, load ${loadavg()[0]!.toFixed(2)}\n`,
);
console.log(
  "| scenario | bodies | answers | seconds | health requests | failed | p50 ms | p99 ms | max ms | event-loop delay max ms | RSS before MB | peak RSS above it MB |",
);
console.log("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
for (const row of rows) console.log(row);
