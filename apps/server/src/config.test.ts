import { describe, expect, it } from "vitest";
import { configFromEnv } from "./config.ts";

describe("configFromEnv", () => {
  it("when ARBOR_ENGINE_THREADS is set, then it is the engine's thread count, checked at start", () => {
    expect(configFromEnv({ ARBOR_ENGINE_THREADS: "3" }).engineThreads).toBe(3);
    expect(configFromEnv({}).engineThreads).toBeGreaterThanOrEqual(1);
    expect(() => configFromEnv({ ARBOR_ENGINE_THREADS: "two" })).toThrow(
      /ARBOR_ENGINE_THREADS must be an integer from 1 to 64, got "two"/,
    );
  });

  it("when a port or a positive integer setting is bad, then it fails naming the setting", () => {
    expect(() => configFromEnv({ ARBOR_PORT: "70000" })).toThrow(/ARBOR_PORT/);
    expect(() => configFromEnv({ ARBOR_WORKER_LEASE_MS: "0" })).toThrow(/ARBOR_WORKER_LEASE_MS/);
    // A typo must not lift the cap on downloaded training data (NaN would).
    expect(() => configFromEnv({ ARBOR_TRAINING_DATA_MAX_BYTES: "64MB" })).toThrow(
      /ARBOR_TRAINING_DATA_MAX_BYTES must be a positive integer/,
    );
  });
});
