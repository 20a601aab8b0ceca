import { randomBytes } from "node:crypto";
import { unwrap } from "@arbor/client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { REDIS_URL, redisSkipReason } from "./redis.ts";

/**
 * Rate limits kept in Redis (`ARBOR_REDIS_URL`): two servers (two replicas) share a project's
 * requests per minute, and `/v1/system-check` probes the Redis.
 */
const servers: RunningServer[] = [];
const env = { ARBOR_REDIS_URL: REDIS_URL };

beforeAll(async () => {
  if (redisSkipReason !== null) return;
  for (let i = 0; i < 2; i++) {
    servers.push(await startServer({ rateLimits: { projectRequestsPerMinute: 3 } }, { env }));
  }
});
afterAll(async () => {
  for (const server of servers) await server.close();
});

describe.skipIf(redisSkipReason !== null)("rate limits in Redis", () => {
  it("when a project's chats go to two replicas, then its requests per minute hold across both", async () => {
    expect(servers.map((s) => s.rateLimits.backend)).toEqual(["redis", "redis"]);
    // Both servers' admins act in entity `default`: one project, fresh for this run.
    const project = `default/redis-${randomBytes(4).toString("hex")}`;
    const clients = servers.map((s) =>
      s.authorizedClient({ headers: { "Compat-Project": project } }),
    );
    const statuses: number[] = [];
    for (let i = 0; i < 6; i++) {
      const { response } = await clients[i % 2]!.POST("/v1/chat/completions", {
        body: {
          model: "arbor/tiny-chat",
          messages: [{ role: "user", content: "Hi" }],
          max_tokens: 1,
        },
      });
      statuses.push(response.status);
    }
    expect(statuses).toEqual([200, 200, 200, 429, 429, 429]);
  });

  it("when Redis keeps the limits, then system-check probes it; when it cannot be reached, then 503 naming it", async () => {
    const report = unwrap(await servers[0]!.client().GET("/v1/system-check"));
    expect(report.redis).toEqual({ success: true, duration: expect.any(Number), error: null });

    const broken = await startServer({}, { env });
    try {
      await broken.rateLimits.close();
      const result = await broken.client().GET("/v1/system-check");
      expect(result.response.status).toBe(503);
      const failed = result.error as unknown as Record<string, { success: boolean }>;
      expect(failed.redis).toMatchObject({ success: false, error: expect.any(String) });
      expect(failed.database).toMatchObject({ success: true });
      // A chat that cannot be counted is refused, not let through.
      const limited = await startServer({ rateLimits: { keyRequestsPerMinute: 5 } }, { env });
      try {
        await limited.rateLimits.close();
        const chat = await limited.authorizedClient().POST("/v1/chat/completions", {
          body: { model: "arbor/tiny-chat", messages: [{ role: "user", content: "Hi" }] },
        });
        expect(chat.response.status).toBe(503);
        expect(chat.error).toMatchObject({ error: { code: "rate_limits_unavailable" } });
      } finally {
        await limited.close();
      }
    } finally {
      await broken.close();
    }
  });
});

describe("rate limits without Redis", () => {
  it("when no Redis is configured, then system-check has no redis probe", async () => {
    const server = await startServer();
    try {
      const report = unwrap(await server.client().GET("/v1/system-check"));
      expect(report.redis).toBeUndefined();
      expect(server.rateLimits.backend).toBe("memory");
    } finally {
      await server.close();
    }
  });
});
