import { type ArborClient, unwrap } from "@arbor/client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/** A base model served by an OpenAI-compatible upstream: here a second, real Arbor server. */
const REMOTE = "remote/tiny-chat";
let upstream: RunningServer;
let server: RunningServer;
let client: ArborClient;
beforeAll(async () => {
  upstream = await startServer();
  server = await startServer({
    upstreams: {
      [REMOTE]: {
        url: `${upstream.baseUrl}/v1`,
        apiKey: upstream.adminKey,
        model: "arbor/tiny-chat",
      },
    },
  });
  client = server.authorizedClient({ project: "default/upstream" });
});
afterAll(async () => {
  await server.close();
  await upstream.close().catch(() => {});
});

describe("upstreams", () => {
  it("when models are listed, then the upstream's model is there as a base model", async () => {
    const { data } = await client.models.list();
    expect(data).toContainEqual({
      id: REMOTE,
      object: "model",
      created: 0,
      owned_by: "system",
      root: REMOTE,
      parent: null,
    });
  });

  it("when a chat is forwarded, then the answer names our model id and its usage is recorded here", async () => {
    const completion = await client.chat.completions.create({
      model: REMOTE,
      messages: [{ role: "user", content: "What is 2 + 2?" }],
      max_tokens: 8,
      temperature: 0,
    });
    expect(completion.model).toBe(REMOTE);
    expect(completion.usage.completion_tokens).toBeGreaterThan(0);
    const direct = await upstream.authorizedClient().chat.completions.create({
      model: "arbor/tiny-chat",
      messages: [{ role: "user", content: "What is 2 + 2?" }],
      max_tokens: 8,
      temperature: 0,
    });
    expect(completion.choices[0]!.message.content).toBe(direct.choices[0]!.message.content);
    const { calls } = unwrap(
      await server
        .authorizedClient()
        .POST("/calls/query", { body: { project_id: "default/upstream" } }),
    );
    expect(calls[0]!.summary.usage).toEqual({
      [REMOTE]: {
        requests: 1,
        prompt_tokens: completion.usage.prompt_tokens,
        completion_tokens: completion.usage.completion_tokens,
        total_tokens: completion.usage.total_tokens,
      },
    });
  });

  it("when a chat is streamed through, then the chunks name our model and the usage comes last only when asked", async () => {
    const withUsage = [];
    for await (const chunk of await client.chat.completions.create({
      model: REMOTE,
      messages: [{ role: "user", content: "Hi" }],
      max_tokens: 6,
      seed: 2,
      stream_options: { include_usage: true },
      stream: true,
    })) {
      expect(chunk.model).toBe(REMOTE);
      withUsage.push(chunk);
    }
    expect(withUsage.at(-1)!.choices).toEqual([]);
    expect(withUsage.at(-1)!.usage!.completion_tokens).toBeGreaterThan(0);
    const without = [];
    for await (const chunk of await client.chat.completions.create({
      model: REMOTE,
      messages: [{ role: "user", content: "Hi" }],
      max_tokens: 6,
      seed: 2,
      stream: true,
    }))
      without.push(chunk);
    expect(without.every((c) => c.usage === undefined && c.choices.length > 0)).toBe(true);
  });

  it("when the upstream refuses the request, then its 400 comes back in our envelope", async () => {
    const { response, error } = await client.POST("/v1/chat/completions", {
      body: {
        model: REMOTE,
        messages: [{ role: "user", content: "Hi" }],
        logit_bias: { "1": 5 },
      } as never,
    });
    expect(response.status).toBe(400);
    expect(error).toEqual({
      error: {
        message: "`logit_bias` is not supported by this model.",
        type: "invalid_request_error",
        param: null,
        code: null,
      },
    });
  });

  it("when the upstream refuses a streamed request, then its 400 is still a plain error response", async () => {
    const { response, error } = await client.POST("/v1/chat/completions", {
      body: {
        model: REMOTE,
        messages: [{ role: "user", content: "Hi" }],
        stream: true,
        logit_bias: { "1": 5 },
      } as never,
    });
    expect(response.status).toBe(400);
    expect(response.headers.get("content-type")).toMatch(/^application\/json/);
    expect(error).toMatchObject({
      error: { message: "`logit_bias` is not supported by this model." },
    });
  });

  it("when a chat with tools is forwarded, then the upstream's tool calls come back as it made them, whole and streamed, and usage is recorded", async () => {
    const body = {
      messages: [{ role: "user" as const, content: "Time?" }],
      tools: [
        {
          type: "function" as const,
          function: {
            name: "time",
            parameters: {
              type: "object",
              properties: { tz: { type: "string" } },
              required: ["tz"],
            },
          },
        },
      ],
      tool_choice: { type: "function" as const, function: { name: "time" } },
      max_tokens: 40,
      temperature: 0,
    };
    const direct = await upstream
      .authorizedClient()
      .chat.completions.create({ ...body, model: "arbor/tiny-chat" });
    const call = direct.choices[0]!.message.tool_calls![0]!;
    const project = "default/upstream-tools";
    const tools = server.authorizedClient({ project });
    const forwarded = await tools.chat.completions.create({ ...body, model: REMOTE });
    expect(forwarded.choices[0]!.finish_reason).toBe(direct.choices[0]!.finish_reason);
    const toolCalls = forwarded.choices[0]!.message.tool_calls;
    expect(toolCalls).toEqual([
      { id: expect.stringMatching(/^call_/), type: "function", function: call.function },
    ]);
    expect(forwarded.usage).toEqual(direct.usage);
    const pieces = [];
    for await (const chunk of await tools.chat.completions.create({
      ...body,
      model: REMOTE,
      stream: true,
    })) {
      pieces.push(...chunk.choices.flatMap((c) => c.delta.tool_calls ?? []));
    }
    expect(pieces[0]).toMatchObject({ index: 0, type: "function", function: { name: "time" } });
    expect(pieces.map((p) => p.function?.arguments ?? "").join("")).toBe(call.function.arguments);
    // Both calls are recorded with their calls; the whole one with the upstream's usage.
    const { calls } = await client.calls.query({ project_id: project });
    expect(calls.map((c) => c.output)).toMatchObject([
      { choices: [{ message: { content: null, tool_calls: toolCalls } }] },
      {
        choices: [
          {
            message: {
              content: null,
              tool_calls: [{ id: pieces[0]!.id, function: call.function }],
            },
          },
        ],
      },
    ]);
    expect(calls[0]!.summary.usage).toEqual({
      [REMOTE]: {
        requests: 1,
        prompt_tokens: forwarded.usage!.prompt_tokens,
        completion_tokens: forwarded.usage!.completion_tokens,
        total_tokens: forwarded.usage!.total_tokens,
      },
    });
  });

  it("when the upstream is down, then 503 server_error with x-should-retry", async () => {
    await upstream.close();
    const { response, error } = await client.POST("/v1/chat/completions", {
      body: {
        model: REMOTE,
        messages: [{ role: "user", content: "Hi" }],
        max_tokens: 2,
      },
    });
    expect(response.status).toBe(503);
    expect(response.headers.get("x-should-retry")).toBe("true");
    expect((error as { error: { type: string } }).error.type).toBe("server_error");
  });
});
