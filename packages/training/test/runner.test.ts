import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { SftExample } from "@arbor/engine";
import { openStore, type Store } from "@arbor/store";
import { pino } from "pino";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { MAX_JOB_EXAMPLES } from "../src/jobs.ts";
import { catalogModels } from "../src/runner/loaders.ts";
import { TrainingWorker } from "../src/runner/runner.ts";

/** The runner, without HTTP: a job's size is bounded before its first step. */
let dataDir: string;
let store: Store;
beforeAll(async () => {
  dataDir = mkdtempSync(join(tmpdir(), "arbor-runner-"));
  store = await openStore({ dataDir });
  await store.entities.ensure("e");
});
afterAll(async () => {
  await store.close();
  rmSync(dataDir, { recursive: true, force: true });
});

const example: SftExample = {
  messages: [
    { role: "user", content: "Hi" },
    { role: "assistant", content: "Hello" },
  ],
};

describe("TrainingWorker.runJob", () => {
  it("when an SFT job would train on more examples than a job may, then it fails before its first step, naming the limit", async () => {
    const { model } = await store.models.create({
      entity: "e",
      project: "p",
      name: "big",
      base_model: "arbor/tiny-chat",
      initialCheckpoint: {},
    });
    const lines = Math.floor(MAX_JOB_EXAMPLES / 1000) + 1;
    const worker = new TrainingWorker({
      store,
      logger: pino({ level: "silent" }),
      loadBaseModel: catalogModels(),
      loadSftExamples: async () => Array.from({ length: lines }, () => example),
    });
    await store.jobs.enqueue({
      type: "sft",
      model_id: model.id,
      entity: "e",
      config: { config: { epochs: 1000 }, experimental_config: {} },
      payload_ref: "https://data.example/big.jsonl",
    });
    const job = await store.jobs.claimNextJob(worker.workerId, 60_000);
    await worker.runJob(job!);
    const after = await store.jobs.get("e", job!.id);
    expect(after?.status).toBe("failed");
    expect(after?.error_message).toContain(`limit of ${MAX_JOB_EXAMPLES}`);
    const events = (await store.jobs.listEvents("e", job!.id)).data;
    expect(events.map((e) => e.type)).toEqual(["training_failed"]);
  });
});
