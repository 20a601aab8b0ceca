import { runRlLoop } from "@arbor/examples/rl-loop";
import { runSftQuickstart } from "@arbor/examples/sft-quickstart";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/** The examples, end to end through the HTTP API on the shipped model: they must learn. */
let server: RunningServer;
beforeAll(async () => {
  server = await startServer({}, { worker: true });
});
afterAll(() => server.close());

const quiet = () => {};

describe("examples", () => {
  it("when the SFT quickstart runs, then held-out exact match rises well above the base model's", async () => {
    const result = await runSftQuickstart(server.authorizedClient(), quiet);
    expect(result.before).toBeLessThanOrEqual(0.1);
    expect(result.after).toBeGreaterThanOrEqual(0.5);
  });

  it("when the RL loop runs, then the mean reward on fresh samples rises", async () => {
    const result = await runRlLoop(server.authorizedClient(), {}, quiet);
    expect(result.before).toBeLessThan(0.7);
    expect(result.after).toBeGreaterThanOrEqual(result.before + 0.2);
  });
});
