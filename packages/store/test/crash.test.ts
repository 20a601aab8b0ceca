import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { expect, it } from "vitest";
import { openStore } from "../src/index.ts";
import { describeBackends } from "./helpers.ts";

const WRITER = fileURLToPath(new URL("./fixtures/writer.ts", import.meta.url));

/** Runs the writer until it has done `ticks` iterations, then SIGKILLs it mid-write. */
function runAndKill(options: object, ticks: number): Promise<number> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [WRITER, JSON.stringify(options)], {
      stdio: ["ignore", "pipe", "pipe"],
    });
    let seen = 0;
    let stderr = "";
    child.stderr.on("data", (d: Buffer) => {
      stderr += d.toString();
    });
    child.stdout.on("data", (d: Buffer) => {
      seen += (d.toString().match(/tick/g) ?? []).length;
      if (seen >= ticks && child.exitCode === null) child.kill("SIGKILL");
    });
    child.on("exit", (code, signal) => {
      if (signal === "SIGKILL") resolve(seen);
      else reject(new Error(`writer exited with ${code}: ${stderr}`));
    });
  });
}

describeBackends("a writer killed with SIGKILL", (ctx) => {
  it("when killed mid-writes, then the store reopens consistent", async () => {
    const { now: _now, ...options } = ctx.options();
    const ticks = await runAndKill(options, 15);
    expect(ticks).toBeGreaterThanOrEqual(15);

    const store = await openStore(options);
    try {
      if (store.dialect === "sqlite") {
        const check = await store.sql.query<{ integrity_check: string }>("PRAGMA integrity_check");
        expect(check.map((c) => c.integrity_check)).toEqual(["ok"]);
      }
      // Every model was written with its step-0 checkpoint, and latest_step matches its checkpoints.
      const bad = await store.sql.query(
        `SELECT m.id FROM models m
         WHERE m.entity = 'crash-ent'
           AND (NOT EXISTS (SELECT 1 FROM checkpoints c WHERE c.model_id = m.id AND c.step = 0)
                OR m.latest_step <> (SELECT MAX(c.step) FROM checkpoints c WHERE c.model_id = m.id))`,
      );
      expect(bad).toEqual([]);
      const models = await store.sql.query("SELECT id FROM models WHERE entity = 'crash-ent'");
      expect(models.length).toBeGreaterThanOrEqual(ticks);
      // A call batch is all or nothing.
      const traces = await store.sql.query<{ n: number }>(
        "SELECT COUNT(*) AS n FROM calls WHERE project_id = 'crash/p' GROUP BY trace_id",
      );
      for (const t of traces) expect(Number(t.n)).toBe(50);
      // A dataset row only exists once its blob is complete.
      const datasets = await store.datasets.list("crash-ent", { limit: 1000 });
      expect(datasets.data.length).toBeGreaterThanOrEqual(ticks);
      for (const d of datasets.data) {
        const blob = await store.blobs.get(d.blob_key);
        expect(blob?.length).toBe(d.bytes);
      }
      // The store still takes writes.
      await store.entities.ensure("after-crash");
    } finally {
      await store.close();
    }
  });
});
