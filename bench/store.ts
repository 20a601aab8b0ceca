// Store benchmark: `node bench/store.ts [--backend sqlite|postgres|both] [--sizes 1000,10000,100000]`
// Prints a markdown table. PostgreSQL comes from DATABASE_URL (default the local test database);
// it runs in a throwaway schema that is dropped at the end.
import { spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { openStore, type Store, type StoreOptions } from "../packages/store/src/index.ts";
import { seedPrices, treeBatches } from "./calls-tree.ts";

const PG_URL = process.env.DATABASE_URL ?? "postgres://postgres@127.0.0.1:5432/test";
const SELF = fileURLToPath(import.meta.url);

const { values } = parseArgs({
  options: {
    backend: { type: "string", default: "both" },
    sizes: { type: "string", default: "1000,10000,100000" },
    "usage-child": { type: "string" },
  },
});

interface Row {
  backend: string;
  measure: string;
  value: string;
}

function rate(n: number, ms: number): string {
  return `${Math.round((n / ms) * 1000).toLocaleString("en-US")}/s`;
}

async function usageChild(arg: string): Promise<void> {
  const { options, project } = JSON.parse(arg) as { options: StoreOptions; project: string };
  const store = await openStore(options);
  const roots = Array.from({ length: 100 }, (_, i) => `c${i}`);
  await store.calls.callUsage(project, roots.slice(0, 1), { limit: 1e9 }); // warm the statement cache
  const before = process.memoryUsage().rss;
  // The median of 9 requests: one run on a shared machine is too noisy to quote.
  const times: number[] = [];
  let result = await store.calls.callUsage(project, roots, { includeCosts: true, limit: 1e9 });
  for (let i = 0; i < 9; i++) {
    const started = performance.now();
    result = await store.calls.callUsage(project, roots, { includeCosts: true, limit: 1e9 });
    times.push(performance.now() - started);
  }
  const ms = times.sort((a, b) => a - b)[4]!;
  const requests = Object.values(result.call_usage).reduce(
    (sum, byModel) => sum + Object.values(byModel).reduce((s, u) => s + u.requests, 0),
    0,
  );
  await store.close();
  process.stdout.write(
    JSON.stringify({
      ms,
      requests,
      rssBefore: before,
      maxRss: process.resourceUsage().maxRSS * 1024,
    }),
  );
}

async function bench(backend: "sqlite" | "postgres", sizes: number[]): Promise<Row[]> {
  const rows: Row[] = [];
  const dir = mkdtempSync(join(tmpdir(), "arbor-bench-"));
  const schema = `arbor_bench_${randomBytes(4).toString("hex")}`;
  const options: StoreOptions =
    backend === "sqlite"
      ? { dataDir: dir }
      : { databaseUrl: PG_URL, schema, blobDir: join(dir, "blobs") };
  const store: Store = await openStore(options);
  const add = (measure: string, value: string) => {
    rows.push({ backend, measure, value });
    console.error(`${backend}: ${measure} = ${value}`);
  };
  try {
    const entity = "bench";
    await store.entities.ensure(entity);

    // Single-row inserts, one autocommit statement each.
    const n = backend === "sqlite" ? 5000 : 2000;
    let t = performance.now();
    for (let i = 0; i < n; i++) {
      await store.datasets.create({ entity, name: `d${i}`, blob_key: `k${i}`, bytes: i, lines: i });
    }
    add("single-row inserts (datasets.create, sequential)", rate(n, performance.now() - t));

    // Model creates: a transaction writing the model and its step-0 checkpoint.
    const ids: string[] = [];
    t = performance.now();
    for (let i = 0; i < n; i++) {
      const { model } = await store.models.create({
        entity,
        project: "p",
        name: `m${i}`,
        base_model: "b",
        initialCheckpoint: {},
      });
      ids.push(model.id);
    }
    add("model creates (2-row transaction, sequential)", rate(n, performance.now() - t));

    // Concurrent model creates: what a server under load sees.
    t = performance.now();
    await Promise.all(
      Array.from({ length: 8 }, (_, w) =>
        (async () => {
          for (let i = 0; i < n / 8; i++) {
            await store.models.create({
              entity,
              project: "c",
              name: `m${w}-${i}`,
              base_model: "b",
              initialCheckpoint: {},
            });
          }
        })(),
      ),
    );
    add("model creates (8 concurrent callers)", rate(n, performance.now() - t));

    // Point reads by (entity, id).
    const reads = 20000;
    t = performance.now();
    for (let i = 0; i < reads; i++) await store.models.get(entity, ids[(i * 7919) % ids.length]!);
    add("point reads (models.get, sequential)", rate(reads, performance.now() - t));

    t = performance.now();
    await Promise.all(
      Array.from({ length: 8 }, (_, w) =>
        (async () => {
          for (let i = 0; i < reads / 8; i++)
            await store.models.get(entity, ids[(i * 7919 + w) % ids.length]!);
        })(),
      ),
    );
    add("point reads (8 concurrent callers)", rate(reads, performance.now() - t));

    // upsertBatch: 10 batches of 1,000 calls (a start and an end each).
    let calls = 0;
    t = performance.now();
    let b = 0;
    for (const batch of treeBatches("bench/upsert", 10000, 1000)) {
      await store.calls.upsertBatch(batch);
      calls += batch.length / 2;
      b++;
    }
    add(
      `upsertBatch (${b} batches of 1,000 calls = 2,000 items)`,
      `${rate(calls, performance.now() - t)} calls`,
    );

    for (const size of sizes) {
      const project = `bench/usage-${size}`;
      t = performance.now();
      for (const batch of treeBatches(project, size)) await store.calls.upsertBatch(batch);
      const seedMs = performance.now() - t;
      await seedPrices(store, project);
      add(
        `seed ${size.toLocaleString("en-US")} calls (upsertBatch of 5,000)`,
        `${rate(size, seedMs)} calls`,
      );
      // A fresh process runs the aggregation, so its peak RSS is the aggregation's alone.
      const child = spawnSync(
        process.execPath,
        [SELF, "--usage-child", JSON.stringify({ options, project })],
        {
          encoding: "utf8",
          maxBuffer: 1 << 20,
        },
      );
      if (child.status !== 0) throw new Error(`usage child failed: ${child.stderr}`);
      const r = JSON.parse(child.stdout) as {
        ms: number;
        requests: number;
        rssBefore: number;
        maxRss: number;
      };
      if (r.requests !== size)
        throw new Error(`usage counted ${r.requests} requests, expected ${size}`);
      const mb = (x: number) => `${(x / 1048576).toFixed(0)} MB`;
      add(
        `callUsage ${size.toLocaleString("en-US")} calls (100 roots, depth ≤ 8, 3 models, with costs), p50 of 9`,
        `${r.ms.toFixed(0)} ms; peak RSS ${mb(r.maxRss)} (${mb(r.rssBefore)} before the query)`,
      );
    }
  } finally {
    if (backend === "postgres") await store.sql.exec(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
    await store.close();
    rmSync(dir, { recursive: true, force: true });
  }
  return rows;
}

if (values["usage-child"]) {
  await usageChild(values["usage-child"]);
} else {
  const sizes = values.sizes!.split(",").map(Number);
  const backends =
    values.backend === "both"
      ? (["sqlite", "postgres"] as const)
      : [values.backend as "sqlite" | "postgres"];
  const rows: Row[] = [];
  for (const backend of backends) rows.push(...(await bench(backend, sizes)));
  const measures = [...new Set(rows.map((r) => r.measure))];
  console.log(`| measure | ${backends.join(" | ")} |`);
  console.log(`|---|${backends.map(() => "---").join("|")}|`);
  for (const m of measures) {
    const cells = backends.map(
      (b) => rows.find((r) => r.backend === b && r.measure === m)?.value ?? "—",
    );
    console.log(`| ${m} | ${cells.join(" | ")} |`);
  }
  console.log(
    `\nNode ${process.version}, ${new Date().toISOString().slice(0, 10)}; SQLite WAL synchronous=NORMAL in a temp dir; PostgreSQL at ${PG_URL.replace(/\/\/[^@]*@/, "//")}.`,
  );
}
