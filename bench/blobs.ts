// Blob store benchmark: `node bench/blobs.ts [--sizes 4,64] [--runs 3]`
// Writes (`put` of a Buffer), reads whole (`get`) and streams (`stream`, consumed and dropped)
// blobs of each size in MiB on FsBlobStore and PgBlobStore (256 KiB chunk rows). Each operation
// runs in a child process of its own; the table shows MiB/s (the median of the runs), the peak
// RSS above the child's RSS before the operation (garbage not yet collected included), and the
// memory held: heap and buffers after a forced GC, sampled every 4 MiB read and at the end,
// above the same before (what the operation keeps alive, not what it has not freed yet).
// PostgreSQL comes from DATABASE_URL (default the local test database), in a throwaway schema.
import { spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { openStore, PostgresSql, type StoreOptions } from "../packages/store/src/index.ts";

const PG_URL = process.env.DATABASE_URL ?? "postgres://postgres@127.0.0.1:5432/test";
const SELF = fileURLToPath(import.meta.url);
const MiB = 1024 * 1024;

const { values } = parseArgs({
  options: {
    sizes: { type: "string", default: "4,64" },
    runs: { type: "string", default: "3" },
    child: { type: "string" },
  },
});

type Op = "put" | "get" | "stream";
interface ChildSpec {
  options: StoreOptions;
  op: Op;
  key: string;
  mib: number;
}

async function child(spec: ChildSpec): Promise<void> {
  const store = await openStore(spec.options);
  const blobs = store.blobs;
  const body = spec.op === "put" ? randomBytes(spec.mib * MiB) : undefined;
  const gc = (globalThis as { gc?: () => void }).gc!;
  // ArrayBuffers are freed on a thread after the GC that found them dead: collect, let it
  // run, collect again.
  const held = async () => {
    gc();
    await new Promise((resolve) => setTimeout(resolve, 20));
    gc();
    const { heapUsed, arrayBuffers } = process.memoryUsage();
    return heapUsed + arrayBuffers;
  };
  const base = await held();
  let peak = base;
  // Timed without the samples: they are taken between the timed parts.
  let ms = 0;
  let bytes = 0;
  const before = process.memoryUsage().rss;
  let started = performance.now();
  if (spec.op === "put") bytes = (await blobs.put(spec.key, body!)).bytes;
  else if (spec.op === "get") {
    const whole = await blobs.get(spec.key);
    ms += performance.now() - started;
    peak = Math.max(peak, await held());
    started = performance.now();
    bytes = whole!.length;
  } else {
    for await (const chunk of (await blobs.stream(spec.key))!) {
      bytes += chunk.length;
      if (bytes % (4 * MiB) < chunk.length) {
        ms += performance.now() - started;
        peak = Math.max(peak, await held());
        started = performance.now();
      }
    }
  }
  ms += performance.now() - started;
  const maxRss = process.resourceUsage().maxRSS * 1024;
  await store.close();
  process.stdout.write(
    JSON.stringify({
      ms,
      bytes,
      rssBefore: before,
      maxRss,
      held: spec.op === "put" ? null : peak - base,
    }),
  );
}

function runChild(spec: ChildSpec) {
  const out = spawnSync(process.execPath, ["--expose-gc", SELF, "--child", JSON.stringify(spec)], {
    encoding: "utf8",
    maxBuffer: 1 << 20,
  });
  if (out.status !== 0) throw new Error(`child failed: ${out.stderr}`);
  return JSON.parse(out.stdout) as {
    ms: number;
    bytes: number;
    rssBefore: number;
    maxRss: number;
    held: number | null;
  };
}

async function main(): Promise<void> {
  if (values.child) return child(JSON.parse(values.child) as ChildSpec);
  const sizes = values.sizes.split(",").map(Number);
  const runs = Number(values.runs);
  const dir = mkdtempSync(join(tmpdir(), "arbor-bench-blobs-"));
  const schema = `arbor_bench_${randomBytes(4).toString("hex")}`;
  const backends: [string, StoreOptions][] = [
    ["fs", { dataDir: dir }],
    ["postgres", { databaseUrl: PG_URL, schema, blobs: "postgres" }],
  ];
  const rows: string[] = [];
  try {
    // Creates the schema and its tables once.
    await (await openStore(backends[1]![1])).close();
    for (const [name, options] of backends) {
      for (const mib of sizes) {
        for (const op of ["put", "get", "stream"] as const) {
          const results = Array.from({ length: runs }, (_, i) =>
            runChild({ options, op, key: `bench/${mib}-${op === "put" ? i : 0}`, mib }),
          );
          const rates = results.map((r) => r.bytes / MiB / (r.ms / 1000)).sort((a, b) => a - b);
          const rss = Math.max(...results.map((r) => (r.maxRss - r.rssBefore) / MiB));
          const held = results[0]!.held;
          const kept =
            held === null ? "–" : Math.max(...results.map((r) => r.held! / MiB)).toFixed(1);
          const row = `| ${name} | ${mib} MiB | ${op} | ${rates[Math.floor(rates.length / 2)]!.toFixed(0)} | ${rss.toFixed(0)} | ${kept} |`;
          rows.push(row);
          console.error(row);
        }
      }
    }
  } finally {
    const cleanup = new PostgresSql({ connectionString: PG_URL });
    await cleanup.exec(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
    await cleanup.close();
    rmSync(dir, { recursive: true, force: true });
  }
  console.log(
    "| store | size | operation | MiB/s (median) | peak RSS above start (MiB) | held after GC, peak (MiB) |",
  );
  console.log("|---|---|---|---:|---:|---:|");
  for (const row of rows) console.log(row);
}

await main();
