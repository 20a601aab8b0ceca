// calls.callUsage benchmark: `node bench/calls-usage.ts [--backend sqlite|postgres|both]
//   [--sizes 10000,100000] [--limits 10000,1000000] [--runs 21] [--orphans]`
// Seeds one project per size (100 roots, depth ≤ 8, 3 models, priced) in one store, then, in a
// fresh child process per size and limit (so its peak RSS is the aggregation's own), asks for
// the usage of the 100 roots with costs `runs` times after one warm-up, and prints a markdown
// table of p50/p95 and peak RSS. PostgreSQL comes from DATABASE_URL (default the local test
// database), in a throwaway schema dropped at the end. `--orphans` adds to each trace a call
// whose parent never arrives, so every sum walks parent links (the slower path).
import { spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { LimitExceededError, openStore, type StoreOptions } from "../packages/store/src/index.ts";
import { ROOTS, seedPrices, treeBatches } from "./calls-tree.ts";

const PG_URL = process.env.DATABASE_URL ?? "postgres://postgres@127.0.0.1:5432/test";
const SELF = fileURLToPath(import.meta.url);

const { values } = parseArgs({
  options: {
    backend: { type: "string", default: "both" },
    sizes: { type: "string", default: "10000,100000" },
    limits: { type: "string", default: "10000,1000000" },
    runs: { type: "string", default: "21" },
    orphans: { type: "boolean", default: false },
    child: { type: "string" },
  },
});

interface ChildResult {
  p50: number;
  p95: number;
  requests: number;
  rssBefore: number;
  maxRss: number;
  refused?: string;
}

const quantile = (sorted: number[], q: number) =>
  sorted[Math.min(sorted.length - 1, Math.ceil(q * sorted.length) - 1)]!;

async function child(arg: string): Promise<void> {
  const { options, project, limit, runs } = JSON.parse(arg) as {
    options: StoreOptions;
    project: string;
    limit: number;
    runs: number;
  };
  const store = await openStore(options);
  const roots = Array.from({ length: ROOTS }, (_, i) => `c${i}`);
  const ask = () => store.calls.callUsage(project, roots, { includeCosts: true, limit });
  const rssBefore = process.memoryUsage().rss;
  let result: Awaited<ReturnType<typeof ask>>;
  try {
    result = await ask(); // warm-up: statement caches, the database's buffers
  } catch (err) {
    if (!(err instanceof LimitExceededError)) throw err;
    await store.close();
    process.stdout.write(
      JSON.stringify({ p50: 0, p95: 0, requests: 0, rssBefore, maxRss: 0, refused: err.message }),
    );
    return;
  }
  const times: number[] = [];
  for (let i = 0; i < runs; i++) {
    const started = performance.now();
    result = await ask();
    times.push(performance.now() - started);
  }
  times.sort((a, b) => a - b);
  const requests = Object.values(result.call_usage).reduce(
    (sum, byModel) => sum + Object.values(byModel).reduce((s, u) => s + u.requests, 0),
    0,
  );
  await store.close();
  const out: ChildResult = {
    p50: quantile(times, 0.5),
    p95: quantile(times, 0.95),
    requests,
    rssBefore,
    maxRss: process.resourceUsage().maxRSS * 1024,
  };
  process.stdout.write(JSON.stringify(out));
}

interface Row {
  backend: string;
  size: number;
  limit: number;
  cell: string;
}

async function bench(
  backend: "sqlite" | "postgres",
  sizes: number[],
  limits: number[],
  runs: number,
): Promise<Row[]> {
  const rows: Row[] = [];
  const dir = mkdtempSync(join(tmpdir(), "arbor-bench-"));
  const schema = `arbor_bench_${randomBytes(4).toString("hex")}`;
  const options: StoreOptions =
    backend === "sqlite"
      ? { dataDir: dir }
      : { databaseUrl: PG_URL, schema, blobDir: join(dir, "blobs") };
  const store = await openStore(options);
  try {
    for (const size of sizes) {
      const project = `bench/usage-${size}`;
      const t = performance.now();
      for (const batch of treeBatches(project, size, 5000, values.orphans))
        await store.calls.upsertBatch(batch);
      await seedPrices(store, project);
      const seconds = (performance.now() - t) / 1000;
      console.error(
        `${backend}: seeded ${size} calls in ${seconds.toFixed(1)} s (${Math.round(size / seconds)} calls/s)`,
      );
    }
    if (backend === "postgres") await store.sql.exec("ANALYZE");
    for (const size of sizes) {
      for (const limit of limits) {
        const project = `bench/usage-${size}`;
        const run = spawnSync(
          process.execPath,
          [SELF, "--child", JSON.stringify({ options, project, limit, runs })],
          { encoding: "utf8", maxBuffer: 1 << 20 },
        );
        if (run.status !== 0) throw new Error(`child failed: ${run.stderr}`);
        const r = JSON.parse(run.stdout) as ChildResult;
        const mb = (x: number) => `${(x / 1048576).toFixed(0)} MB`;
        let cell: string;
        if (r.refused) cell = "413";
        else {
          if (r.requests !== size)
            throw new Error(`usage counted ${r.requests} requests, expected ${size}`);
          cell = `${r.p50.toFixed(0)} / ${r.p95.toFixed(0)} ms; peak RSS ${mb(r.maxRss)} (${mb(r.rssBefore)} before)`;
        }
        rows.push({ backend, size, limit, cell });
        console.error(`${backend}: ${size} calls, limit ${limit}: ${cell}`);
      }
    }
  } finally {
    if (backend === "postgres") await store.sql.exec(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
    await store.close();
    rmSync(dir, { recursive: true, force: true });
  }
  return rows;
}

if (values.child) {
  await child(values.child);
} else {
  const sizes = values.sizes!.split(",").map(Number);
  const limits = values.limits!.split(",").map(Number);
  const runs = Number(values.runs);
  const backends =
    values.backend === "both"
      ? (["sqlite", "postgres"] as const)
      : [values.backend as "sqlite" | "postgres"];
  const rows: Row[] = [];
  for (const backend of backends) rows.push(...(await bench(backend, sizes, limits, runs)));
  const fmt = (n: number) => n.toLocaleString("en-US");
  console.log(
    `| calls aggregated (100 roots, depth ≤ 8, 3 models, with costs${values.orphans ? ", every trace walked" : ""}) | limit | ${backends.map((b) => `${b} p50 / p95`).join(" | ")} |`,
  );
  console.log(`|---|---:|${backends.map(() => "---").join("|")}|`);
  for (const size of sizes) {
    for (const limit of limits) {
      const cells = backends.map(
        (b) => rows.find((r) => r.backend === b && r.size === size && r.limit === limit)?.cell,
      );
      console.log(`| ${fmt(size)} | ${fmt(limit)} | ${cells.join(" | ")} |`);
    }
  }
  console.log(
    `\n${runs} runs after one warm-up, each size in its own child process; ${fmt(sizes.reduce((a, b) => a + b, 0))} calls stored. Node ${process.version}, ${new Date().toISOString().slice(0, 10)}; SQLite WAL in a temp dir; PostgreSQL at ${PG_URL.replace(/\/\/[^@]*@/, "//")}.`,
  );
}
