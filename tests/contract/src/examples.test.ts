import { connect, serverUrl } from "@arbor/examples/connect";
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
  it("when only ARBOR_PORT (and ARBOR_HOST) say where the server is, then the examples find it, as the CLI does", async () => {
    const { port } = new URL(server.baseUrl);
    const client = connect({ ARBOR_PORT: port, ARBOR_API_KEY: server.adminKey });
    // An authenticated call: the key went with it.
    expect((await client.models.retrieve("arbor/tiny-chat")).id).toBe("arbor/tiny-chat");
    expect(serverUrl({ ARBOR_HOST: "0.0.0.0", ARBOR_PORT: "18100" })).toBe(
      "http://127.0.0.1:18100",
    );
    expect(serverUrl({ ARBOR_HOST: "::1", ARBOR_PORT: "18100" })).toBe("http://[::1]:18100");
    expect(serverUrl({ ARBOR_BASE_URL: "http://gpu:9000", ARBOR_PORT: "18100" })).toBe(
      "http://gpu:9000",
    );
    expect(serverUrl({})).toBe("http://127.0.0.1:8080");
  });

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
