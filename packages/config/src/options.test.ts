import { describe, expect, it } from "vitest";
import { storeOptionsOf, workerOptionsOf } from "./options.ts";
import { readConfig } from "./settings.ts";

describe("storeOptionsOf and workerOptionsOf", () => {
  it("when the store and training settings are set, then the store and the worker are given them", () => {
    const config = readConfig({
      ARBOR_DATA_DIR: "/srv/arbor",
      DATABASE_URL: "postgres://db/arbor",
      ARBOR_DATABASE_SCHEMA: "tenant_a",
      ARBOR_BLOBS: "fs",
      ARBOR_LOG_LEVEL: "warn",
      ARBOR_TRAINING_THREADS: "2",
      ARBOR_WORKER_LEASE_MS: "30000",
      ARBOR_TRAINING_DATA_MAX_BYTES: "1024",
      ARBOR_TRAINING_DATA_ALLOW_HOSTS: "data.internal",
      ARBOR_ENGINE_THREADS: "3",
      ARBOR_ENGINE_WEIGHTS: "f32",
    });
    const store = {
      dataDir: "/srv/arbor",
      databaseUrl: "postgres://db/arbor",
      schema: "tenant_a",
      blobs: "fs",
    };
    expect(storeOptionsOf(config)).toEqual(store);
    expect(workerOptionsOf(config)).toEqual({
      ...store,
      threads: 2,
      logLevel: "warn",
      leaseMs: 30_000,
      maxTrainingDataBytes: 1024,
      allowHosts: ["data.internal"],
      kernelThreads: 3,
      engineWeights: "f32",
      baseModelsDir: "/srv/arbor/models",
    });
  });

  it("when no store is set, then it is SQLite in the data directory, blobs where the store puts them", () => {
    expect(storeOptionsOf(readConfig({ ARBOR_DATA_DIR: "/srv/arbor" }))).toEqual({
      dataDir: "/srv/arbor",
      databaseUrl: undefined,
      schema: undefined,
      blobs: undefined,
    });
  });
});
