import { mkdirSync, mkdtempSync, readdirSync, rmSync, utimesSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { openStore, type Store, WRITER_TAG } from "@arbor/store";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { writeCheckpointFiles } from "../src/checkpoints.ts";
import { sweepExports } from "../src/exports.ts";
import { sweepBlobs } from "../src/sweep.ts";

let dataDir: string;
let store: Store;
beforeAll(async () => {
  dataDir = mkdtempSync(join(tmpdir(), "arbor-sweep-"));
  store = await openStore({ dataDir });
  await store.entities.ensure("e");
});
afterAll(async () => {
  await store.close();
  rmSync(dataDir, { recursive: true, force: true });
});

const files = { "adapter_config.json": new Uint8Array([1]) };

async function model(name: string) {
  return (
    await store.models.create({
      entity: "e",
      project: "p",
      name,
      base_model: "b",
      initialCheckpoint: {},
    })
  ).model;
}

describe("sweepBlobs", () => {
  it("when checkpoint folders have no row, then they go at once when their model is gone, else after a grace", async () => {
    const idle = await model("idle");
    const busy = await model("busy");
    const named = await writeCheckpointFiles(store.blobs, idle.id, 1, files);
    await store.models.addCheckpoint("e", idle.id, { step: 1, blob_key: named });
    // No job runs for `idle`: an adapter upload on another replica may be between its files
    // and its row (blobs shared in PostgreSQL), so its folder waits out the grace too.
    const uploading = await writeCheckpointFiles(store.blobs, idle.id, 2, files);
    const inFlight = await writeCheckpointFiles(store.blobs, busy.id, 1, files);
    const ofDeletedModel = await writeCheckpointFiles(
      store.blobs,
      "0193a0b3-dead-7000-8000-000000000000",
      1,
      files,
    );
    await store.jobs.enqueue({ type: "rl", model_id: busy.id, entity: "e" });
    await store.jobs.claimNextJob("w", 60_000);

    const swept = await sweepBlobs(store);
    expect(swept.checkpoints).toEqual([ofDeletedModel]);
    for (const kept of [named, uploading, inFlight])
      expect(await store.blobs.exists(`${kept}adapter_config.json`)).toBe(true);

    // A minute on, no upload is still writing; a running job may be, for the whole grace.
    const soon = await sweepBlobs(store, { now: () => Date.now() + 61_000 });
    expect(soon.checkpoints).toEqual([uploading]);
    const later = await sweepBlobs(store, { now: () => Date.now() + 16 * 60_000 });
    expect(later.checkpoints).toEqual([inFlight]);
    expect(await store.blobs.exists(`${named}adapter_config.json`)).toBe(true);
  });

  it("when a dataset file or RL input has no row, then it goes once older than the grace", async () => {
    await store.blobs.put("datasets/unnamed.jsonl", "{}");
    await store.blobs.put("jobs/payloads/unnamed.json", "[]");
    expect((await sweepBlobs(store)).datasets).toEqual([]);
    const later = await sweepBlobs(store, { now: () => Date.now() + 16 * 60_000 });
    expect(later.datasets).toEqual(["datasets/unnamed.jsonl"]);
    expect(later.payloads).toEqual(["jobs/payloads/unnamed.json"]);
  });
});

describe("sweepExports", () => {
  const root = mkdtempSync(join(tmpdir(), "arbor-sweep-exports-"));
  afterAll(() => rmSync(root, { recursive: true, force: true }));

  it("when a GGUF export was cut off, then its folder goes once its writer is gone or it is a day old; a live writer's stays", async () => {
    const host = WRITER_TAG.split("-")[0]!;
    const folder = (name: string, ageMs = 0) => {
      mkdirSync(join(root, name));
      writeFileSync(join(root, name, "export.gguf"), "GGUF");
      const at = new Date(Date.now() - ageMs);
      utimesSync(join(root, name, "export.gguf"), at, at);
      utimesSync(join(root, name), at, at);
    };
    const day = 25 * 60 * 60_000;
    const beforeThisProcess = process.uptime() * 1000 + 60_000;
    // This host: a process that no longer runs (above Linux's default pid_max), one that runs
    // (this one's parent), an earlier process that had this one's pid, and this process.
    folder(`arbor-export-${host}-4194305-a1`);
    folder(`arbor-export-${host}-${process.ppid}-b2`);
    folder(`arbor-export-${WRITER_TAG}-c3`, beforeThisProcess);
    folder(`arbor-export-${WRITER_TAG}-f6`);
    // Another host's, whose processes cannot be seen from here: a day decides, as for a folder
    // named before the writer's tag was.
    folder("arbor-export-0badc0de-12-d4");
    folder("arbor-export-0badc0de-12-e5", day);
    folder("arbor-export-Ab12Cd");
    folder("arbor-export-Ef34Gh", day);
    folder("other-folder", day);
    expect((await sweepExports(root)).sort()).toEqual(
      [
        `arbor-export-${host}-4194305-a1`,
        `arbor-export-${WRITER_TAG}-c3`,
        "arbor-export-0badc0de-12-e5",
        "arbor-export-Ef34Gh",
      ].sort(),
    );
    expect(readdirSync(root).sort()).toEqual(
      [
        `arbor-export-${host}-${process.ppid}-b2`,
        `arbor-export-${WRITER_TAG}-f6`,
        "arbor-export-0badc0de-12-d4",
        "arbor-export-Ab12Cd",
        "other-folder",
      ].sort(),
    );
  });
});
