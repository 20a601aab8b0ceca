import type { ArborClient } from "@arbor/client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/** Bad input on one operation per surface: the right status in the surface's envelope. */
let server: RunningServer;
let client: ArborClient;
beforeAll(async () => {
  server = await startServer();
  client = server.authorizedClient();
});
afterAll(() => server.close());

const malformed = { bodySerializer: () => "{not json" };
const openAiError = (param: string | null, code: string | null = null) => ({
  error: { message: expect.any(String), type: "invalid_request_error", param, code },
});

describe("createModel (training surface)", () => {
  it("when the body is malformed JSON, then 400 invalid_json in OpenAI's envelope", async () => {
    const { response, error } = await client.POST("/v1/preview/models", {
      body: {} as never,
      ...malformed,
    });
    expect(response.status).toBe(400);
    expect(error).toEqual(openAiError(null, "invalid_json"));
  });

  it("when a required field is missing, then 400 naming it", async () => {
    const { response, error } = await client.POST("/v1/preview/models", {
      body: { project: "p", base_model: "arbor/tiny-chat" } as never,
    });
    expect(response.status).toBe(400);
    expect(error).toEqual(openAiError("name"));
  });

  it("when a field has the wrong type, then 400 naming it", async () => {
    const { response, error } = await client.POST("/v1/preview/models", {
      body: { project: "p", name: 7, base_model: "arbor/tiny-chat" } as never,
    });
    expect(response.status).toBe(400);
    expect(error).toEqual(openAiError("name"));
  });

  it("when the path is unknown, then 404 not_found_error", async () => {
    const { response, error } = await client.GET("/v1/preview/nothing-here" as never);
    expect(response.status).toBe(404);
    expect(error).toEqual({
      error: { message: "Unknown path.", type: "not_found_error", param: null, code: null },
    });
  });

  it("when the method is wrong, then 405 in OpenAI's envelope", async () => {
    const { response, error } = await client.PUT("/v1/preview/models" as never, {} as never);
    expect(response.status).toBe(405);
    expect(error).toEqual(openAiError(null, "method_not_allowed"));
  });
});

describe("createChatCompletion (inference surface)", () => {
  it("when the body is malformed JSON, then 400 invalid_json", async () => {
    const { response, error } = await client.POST("/v1/chat/completions", {
      body: {} as never,
      ...malformed,
    });
    expect(response.status).toBe(400);
    expect(error).toEqual(openAiError(null, "invalid_json"));
  });

  it("when messages is missing, then 400 naming it", async () => {
    const { response, error } = await client.POST("/v1/chat/completions", {
      body: { model: "arbor/tiny-chat" } as never,
    });
    expect(response.status).toBe(400);
    expect(error).toEqual(openAiError("messages"));
  });

  it("when a message role is not a role, then 400 naming the element", async () => {
    const { response, error } = await client.POST("/v1/chat/completions", {
      body: { model: "arbor/tiny-chat", messages: [{ role: "robot", content: "hi" }] } as never,
    });
    expect(response.status).toBe(400);
    expect((error as { error: { param: string } }).error.param).toMatch(/^messages\[0\]/);
  });

  it("when the method is wrong, then 405", async () => {
    const { response } = await client.GET("/v1/chat/completions" as never);
    expect(response.status).toBe(405);
  });
});

describe("getCallsUsage (calls surface)", () => {
  const project_id = "acme/bench";

  it("when the body is malformed JSON, then 422 json_invalid in the detail shape", async () => {
    const { response, error } = await client.POST("/calls/usage", {
      body: {} as never,
      ...malformed,
    });
    expect(response.status).toBe(422);
    expect(error).toEqual({
      detail: [{ loc: ["body"], msg: "JSON decode error", type: "json_invalid" }],
    });
  });

  it.each([
    ["a missing call_ids", { project_id }, ["body", "call_ids"], "missing"],
    [
      "an unknown key",
      { project_id, call_ids: [], extra: 1 },
      ["body", "extra"],
      "extra_forbidden",
    ],
    ["a wrong type", { project_id, call_ids: "abc" }, ["body", "call_ids"], "list_type"],
    [
      "an empty project_id",
      { project_id: "", call_ids: [] },
      ["body", "project_id"],
      "string_too_short",
    ],
    ["limit < 1", { project_id, call_ids: [], limit: 0 }, ["body", "limit"], "greater_than_equal"],
  ])("when the body has %s, then 422 with its loc and type", async (_, body, loc, type) => {
    const { response, error } = await client.POST("/calls/usage", { body: body as never });
    expect(response.status).toBe(422);
    const detail = (error as { detail: { loc: unknown[]; type: string; msg: string }[] }).detail;
    expect(detail).toContainEqual({ loc, type, msg: expect.any(String) });
  });

  it("when the path is unknown, then 404 in the detail shape", async () => {
    const { response, error } = await client.POST("/calls/nothing" as never, { body: {} } as never);
    expect(response.status).toBe(404);
    expect(error).toEqual({ detail: "Unknown path." });
  });

  it("when the method is wrong, then 405 in the detail shape", async () => {
    const { response, error } = await client.GET("/calls/usage" as never);
    expect(response.status).toBe(405);
    expect(error).toEqual({ detail: expect.any(String) });
  });
});

describe("no stack traces", () => {
  it("when any error is answered, then its body holds no stack frame", async () => {
    const answers = await Promise.all([
      client.POST("/calls/usage", { body: {} as never, ...malformed }),
      client.POST("/v1/preview/models", { body: {} as never, ...malformed }),
      client.GET("/v1/unknown" as never),
    ]);
    for (const { error } of answers)
      expect(JSON.stringify(error)).not.toMatch(/at \S+ \(|node_modules|\.ts:\d+/);
  });
});
