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
  it("when every dependency answers, then 200 with each probe's real result", async () => {
    const result = await server.client().GET("/v1/system-check");
    expect(result.response.status).toBe(200);
    const report = unwrap(result);
    expect(report.api).toBe(true);
    expect(report.roles).toEqual(["training", "inference", "calls"]);
    expect(report.database).toMatchObject({ success: true, error: null });
    expect(report.database.duration).toBeGreaterThan(0);
    expect(report.queue).toMatchObject({ success: true, error: null, depth: 0 });
    expect(report.engine).toMatchObject({ success: true, error: null, models: 1 });
  });

  it("when the server runs the embedded worker, then its threads are probed too", async () => {
    const withWorker = await startServer({}, { worker: true });
    try {
      const report = unwrap(await withWorker.client().GET("/v1/system-check"));
      expect(report.worker).toEqual({
        success: true,
        duration: expect.any(Number),
        error: null,
        threads: 1,
        running: 1,
      });
    } finally {
      await withWorker.close();
    }
  });

  it("when the database is gone, then 503 naming it, with the other probes' results", async () => {
    const broken = await startServer();
    try {
      await broken.store.close();
      const result = await broken.client().GET("/v1/system-check");
      expect(result.response.status).toBe(503);
      expect(result.response.headers.get("retry-after")).toBe("5");
      const report = result.error as unknown as Record<
        string,
        { success: boolean; error: string | null }
      >;
      expect(report.database!.success).toBe(false);
      expect(report.database!.error).toEqual(expect.any(String));
      expect(report.engine).toMatchObject({ success: true, error: null });
    } finally {
      await broken.close();
    }
  });
});
