import OpenAI from "openai";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/** The official `openai` npm client, unchanged, against the server's `/v1` inference surface. */
const MODEL = "arbor/tiny-chat";
let server: RunningServer;
let limited: RunningServer;
let openai: OpenAI;
beforeAll(async () => {
  server = await startServer();
  limited = await startServer({ rateLimits: { keyRequestsPerMinute: 1 } });
  openai = new OpenAI({ baseURL: `${server.baseUrl}/v1`, apiKey: server.adminKey, maxRetries: 0 });
});
afterAll(async () => {
  await server.close();
  await limited.close();
});

describe("the openai npm client", () => {
  it("when it lists and retrieves models, then the shipped model is there", async () => {
    const ids: string[] = [];
    for await (const model of openai.models.list()) ids.push(model.id);
    expect(ids).toContain(MODEL);
    expect((await openai.models.retrieve(MODEL)).id).toBe(MODEL);
  });

  it("when it creates a chat completion, then it gets a typed completion with usage", async () => {
    const completion = await openai.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "What is 1 + 1?" }],
      max_tokens: 8,
      temperature: 0,
    });
    expect(completion.object).toBe("chat.completion");
    expect(completion.choices[0]!.message.role).toBe("assistant");
    expect(completion.usage!.total_tokens).toBeGreaterThan(0);
  });

  it("when it streams with include_usage, then the text arrives in chunks and the usage last", async () => {
    const stream = await openai.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "Say hi." }],
      max_tokens: 8,
      seed: 1,
      stream: true,
      stream_options: { include_usage: true },
    });
    let text = "";
    let usage: OpenAI.CompletionUsage | null | undefined;
    for await (const chunk of stream) {
      text += chunk.choices[0]?.delta.content ?? "";
      if (chunk.usage) usage = chunk.usage;
    }
    expect(text.length).toBeGreaterThan(0);
    expect(usage!.completion_tokens).toBeGreaterThan(0);
  });

  it("when the project option is set, then usage is recorded under that project", async () => {
    const scoped = new OpenAI({
      baseURL: `${server.baseUrl}/v1`,
      apiKey: server.adminKey,
      project: "default/openai-sdk",
      maxRetries: 0,
    });
    await scoped.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "Hi" }],
      max_tokens: 2,
    });
    const response = await fetch(`${server.baseUrl}/calls/query`, {
      method: "POST",
      headers: { authorization: `Bearer ${server.adminKey}`, "content-type": "application/json" },
      body: JSON.stringify({ project_id: "default/openai-sdk" }),
    });
    expect(((await response.json()) as { calls: unknown[] }).calls).toHaveLength(1);
  });

  it.each([
    [
      "401",
      () =>
        new OpenAI({
          baseURL: `${server.baseUrl}/v1`,
          apiKey: "sk-arb-wrong",
          maxRetries: 0,
        }).models.list(),
      OpenAI.AuthenticationError,
    ],
    ["404", () => openai.models.retrieve("nobody/nothing"), OpenAI.NotFoundError],
    [
      "400",
      () =>
        openai.chat.completions.create({
          model: MODEL,
          messages: [{ role: "user", content: "x" }],
          tools: [{ type: "function", function: { name: "f" } }],
          tool_choice: { type: "function", function: { name: "g" } },
        }),
      OpenAI.BadRequestError,
    ],
  ])(
    "when the server answers %s, then the client throws its error class",
    async (_, call, ErrorClass) => {
      await expect(call()).rejects.toBeInstanceOf(ErrorClass);
    },
  );

  it("when the rate limit is hit, then RateLimitError", async () => {
    const client = new OpenAI({
      baseURL: `${limited.baseUrl}/v1`,
      apiKey: limited.adminKey,
      maxRetries: 0,
    });
    await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "x" }],
      max_tokens: 1,
    });
    await expect(
      client.chat.completions.create({
        model: MODEL,
        messages: [{ role: "user", content: "x" }],
        max_tokens: 1,
      }),
    ).rejects.toBeInstanceOf(OpenAI.RateLimitError);
  });
});
