import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/** Keys, project headers, and what stays public (ADR 16, ADR 17). */
let server: RunningServer;
beforeAll(async () => {
  server = await startServer();
});
afterAll(() => server.close());

const unauthorized = (message: string) => ({
  error: { message, type: "authentication_error", param: null, code: "invalid_api_key" },
});

describe("authentication", () => {
  it.each([
    ["no Authorization header", {}, "Missing API key: send `Authorization: Bearer <API key>`."],
    [
      "a malformed header",
      { authorization: "Token abc" },
      "Malformed Authorization header: expected `Bearer <API key>`.",
    ],
    [
      "an unknown key",
      { authorization: "Bearer sk-arb-unknownunknownunknown" },
      "Invalid API key.",
    ],
    ["a key without our prefix", { authorization: "Bearer sk-proj-123" }, "Invalid API key."],
  ])("when a /v1 request has %s, then 401 invalid_api_key", async (_, headers, message) => {
    const { response, error } = await server.client({ headers }).GET("/v1/models");
    expect(response.status).toBe(401);
    expect(error).toEqual(unauthorized(message));
  });

  it("when a /calls request has no key, then 401 in the detail shape", async () => {
    const { response, error } = await server.client().POST("/calls/usage", {
      body: { project_id: "default/p", call_ids: [] },
    });
    expect(response.status).toBe(401);
    expect(error).toEqual({ detail: "Missing API key: send `Authorization: Bearer <API key>`." });
  });

  it("when a key is revoked, then the next request is refused", async () => {
    const tenant = await server.newTenant("revokee");
    const before = await tenant.client.GET("/v1/models");
    expect(before.response.status).not.toBe(401);
    expect(await server.store.apiKeys.revokeByPrefix(tenant.apiKey.slice(0, 13))).toBe(1);
    const after = await tenant.client.GET("/v1/models");
    expect(after.response.status).toBe(401);
    expect(after.error).toEqual(unauthorized("Invalid API key."));
  });

  it.each([
    ["/v1/health", "application/json"],
    ["/docs", "text/html"],
    ["/openapi.json", "application/json"],
    ["/openapi.yaml", "application/yaml"],
  ])("when %s is fetched without a key, then 200 %s", async (path, type) => {
    const response = await fetch(`${server.baseUrl}${path}`);
    expect(response.status).toBe(200);
    expect(response.headers.get("content-type")).toContain(type);
  });
});

describe("project header", () => {
  it.each(["Compat-Project", "OpenAI-Project"])(
    "when %s names an entity the key is not a member of, then 403 permission_error",
    async (header) => {
      const { response, error } = await server
        .authorizedClient({ headers: { [header]: "someone-else/proj" } })
        .GET("/v1/models");
      expect(response.status).toBe(403);
      expect(error).toEqual({
        error: {
          message: 'This API key may not act for entity "someone-else".',
          type: "permission_error",
          param: null,
          code: "permission_denied",
        },
      });
    },
  );

  it("when the header is malformed, then 400 naming it", async () => {
    const { response, error } = await server
      .authorizedClient({ headers: { "Compat-Project": "no-slash" } })
      .GET("/v1/models");
    expect(response.status).toBe(400);
    expect(error).toEqual({
      error: {
        message: 'Malformed project header "no-slash": expected "<entity>/<project>".',
        type: "invalid_request_error",
        param: "Compat-Project",
        code: "invalid_project",
      },
    });
  });
});
