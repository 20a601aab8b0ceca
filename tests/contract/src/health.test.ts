import { unwrap } from "@arbor/client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

let server: RunningServer;
beforeAll(async () => {
  server = await startServer();
});
afterAll(() => server.close());

describe("getHealth", () => {
  it("when called without a key, then it answers ok with a request id", async () => {
    const result = await server.client().GET("/v1/health");
    expect(result.response.status).toBe(200);
    expect(unwrap(result)).toEqual({ status: "ok" });
    expect(result.response.headers.get("x-request-id")).toMatch(/^[0-9a-f-]{36}$/);
  });

  it("when the request sends its own x-request-id, then the response echoes it", async () => {
    const result = await server
      .client({ headers: { "x-request-id": "trace-abc.123" } })
      .GET("/v1/health");
    expect(result.response.headers.get("x-request-id")).toBe("trace-abc.123");
  });
});

describe("getSystemCheck", () => {
  it("when every dependency answers, then 200 with each probe's success and duration", async () => {
    const result = await server.client().GET("/v1/system-check");
    expect(result.response.status).toBe(200);
    const report = unwrap(result);
    expect(report.api).toBe(true);
    for (const probe of [report.database, report.queue, report.engine]) {
      expect(probe).toMatchObject({ success: true, error: null });
      expect(probe.duration).toBeGreaterThanOrEqual(0);
    }
  });
});
