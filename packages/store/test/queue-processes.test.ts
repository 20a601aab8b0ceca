import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { expect, it } from "vitest";
import { describeBackends } from "./helpers.ts";

const CLAIMER = fileURLToPath(new URL("./fixtures/claimer.ts", import.meta.url));

function runClaimer(options: object, workerId: string): Promise<string[]> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [CLAIMER, JSON.stringify(options), workerId], {
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    let err = "";
    child.stdout.on("data", (d: Buffer) => {
      out += d.toString();
    });
    child.stderr.on("data", (d: Buffer) => {
      err += d.toString();
    });
    child.on("exit", (code) =>
      code === 0 ? resolve(JSON.parse(out) as string[]) : reject(new Error(err)),
    );
  });
}

describeBackends("the queue across processes", (ctx) => {
  it("when three worker processes drain one queue, then every job runs exactly once", async () => {
    const entity = "procs";
    await ctx.store.entities.ensure(entity);
    const jobIds: string[] = [];
    for (let m = 0; m < 5; m++) {
      const { model } = await ctx.store.models.create({
        entity,
        project: "p",
        name: `m${m}`,
        base_model: "b",
      });
      for (let j = 0; j < 6; j++) {
        jobIds.push((await ctx.store.jobs.enqueue({ type: "rl", model_id: model.id, entity })).id);
      }
    }
    const { now: _now, ...options } = ctx.options();
    const results = await Promise.all([0, 1, 2].map((w) => runClaimer(options, `proc-${w}`)));
    const all = results.flat();
    expect(all.sort()).toEqual([...jobIds].sort());
    expect(new Set(all).size).toBe(all.length);
    for (const id of jobIds) {
      const events = await ctx.store.jobs.listEvents(entity, id);
      expect(events.data.map((e) => e.type)).toEqual(["training_started", "training_ended"]);
    }
    expect((await ctx.store.jobs.depth()).succeeded).toBe(jobIds.length);
  });
});
