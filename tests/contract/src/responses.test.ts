import OpenAI from "openai";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/** OpenAI's Responses API over the chat path (ADR 65), through the stock `openai` client and
 * @arbor/client. */
const MODEL = "arbor/tiny-chat";
let server: RunningServer;
let openai: OpenAI;
beforeAll(async () => {
  server = await startServer();
  openai = new OpenAI({ baseURL: `${server.baseUrl}/v1`, apiKey: server.adminKey, maxRetries: 0 });
});
afterAll(() => server.close());

describe("createResponse", () => {
  it("when the openai client creates a response, then it reads the same text the chat path gives, with usage, and the call is recorded", async () => {
    const project = "default/responses";
    const client = new OpenAI({
      baseURL: `${server.baseUrl}/v1`,
      apiKey: server.adminKey,
      maxRetries: 0,
      project,
    });
    const response = await client.responses.create({
      model: MODEL,
      instructions: "Be brief.",
      input: "Say hello",
      max_output_tokens: 6,
      temperature: 0,
      store: false,
      metadata: { run: "r-1" },
    });
    const chat = await openai.chat.completions.create({
      model: MODEL,
      messages: [
        { role: "system", content: "Be brief." },
        { role: "user", content: "Say hello" },
      ],
      max_completion_tokens: 6,
      temperature: 0,
    });
    expect(response).toMatchObject({
      object: "response",
      model: MODEL,
      status: chat.choices[0]!.finish_reason === "length" ? "incomplete" : "completed",
      instructions: "Be brief.",
      max_output_tokens: 6,
      metadata: { run: "r-1" },
      store: false,
      error: null,
      usage: {
        input_tokens: chat.usage!.prompt_tokens,
        output_tokens: chat.usage!.completion_tokens,
        total_tokens: chat.usage!.total_tokens,
      },
    });
    expect(response.id).toMatch(/^resp_[0-9a-f]{32}$/);
    expect(response.output_text).toBe(chat.choices[0]!.message.content);
    expect(response.output).toEqual([
      {
        type: "message",
        id: expect.stringMatching(/^msg_/),
        status: response.status,
        role: "assistant",
        content: [{ type: "output_text", text: response.output_text, annotations: [] }],
      },
    ]);
    const { calls } = await server.authorizedClient().calls.query({ project_id: project });
    expect(calls).toHaveLength(1);
    expect(calls[0]!.attributes).toEqual({ metadata: { run: "r-1" } });
  });

  it("when streamed through the openai client, then the events come in OpenAI's order and their deltas make the final text", async () => {
    const stream = await openai.responses.create({
      model: MODEL,
      input: [{ role: "user", content: [{ type: "input_text", text: "Say hello" }] }],
      max_output_tokens: 8,
      temperature: 0,
      stream: true,
    });
    const types: string[] = [];
    let deltas = "";
    let last: OpenAI.Responses.Response | undefined;
    for await (const event of stream) {
      types.push(event.type);
      if (event.type === "response.output_text.delta") deltas += event.delta;
      if (event.type === "response.completed" || event.type === "response.incomplete")
        last = event.response;
    }
    const middle = types.filter((t) => t === "response.output_text.delta").length;
    expect(types).toEqual([
      "response.created",
      "response.in_progress",
      "response.output_item.added",
      "response.content_part.added",
      ...Array(middle).fill("response.output_text.delta"),
      "response.output_text.done",
      "response.content_part.done",
      "response.output_item.done",
      last?.status === "incomplete" ? "response.incomplete" : "response.completed",
    ]);
    expect(middle).toBeGreaterThan(0);
    const whole = await openai.responses.create({
      model: MODEL,
      input: "Say hello",
      max_output_tokens: 8,
      temperature: 0,
    });
    expect(deltas).toBe(whole.output_text);
    expect(last?.output[0]).toMatchObject({ content: [{ type: "output_text", text: deltas }] });
    expect(last?.usage?.output_tokens).toBe(whole.usage?.output_tokens);
  });

  it("when @arbor/client creates one with a JSON schema format, then the text is JSON of that schema", async () => {
    const client = server.authorizedClient();
    const response = await client.responses.create({
      model: MODEL,
      input: "Give a number.",
      max_output_tokens: 24,
      text: {
        format: {
          type: "json_schema",
          name: "n",
          strict: true,
          schema: {
            type: "object",
            properties: { n: { type: "integer" } },
            required: ["n"],
            additionalProperties: false,
          },
        },
      },
    });
    expect(response.text.format).toMatchObject({ type: "json_schema", name: "n" });
    if (response.status === "completed") {
      const parsed = JSON.parse(response.output[0]!.content[0]!.text);
      expect(Object.keys(parsed)).toEqual(["n"]);
      expect(Number.isInteger(parsed.n)).toBe(true);
    }
    const streamed = await client.responses.create({
      model: MODEL,
      input: "Hi",
      max_output_tokens: 2,
      stream: true,
    });
    const seen: string[] = [];
    for await (const event of streamed) seen.push(event.type);
    expect(seen.at(-1)).toMatch(/^response\.(completed|incomplete)$/);
  });

  it.each([
    [
      "previous_response_id",
      { previous_response_id: "resp_1" },
      "`previous_response_id` is not supported: Arbor's responses are stateless and none is kept to continue from (send the whole conversation in `input`).",
      "unsupported_parameter",
    ],
    [
      "tools",
      { tools: [{ type: "function", name: "f", parameters: {} }] },
      "`tools` are not served on /v1/responses yet: use /v1/chat/completions for tool calling.",
      "unsupported_parameter",
    ],
    [
      "background",
      { background: true },
      "`background` is not supported on /v1/responses.",
      "unsupported_parameter",
    ],
    [
      "input[0].content[1]",
      {
        input: [
          {
            role: "user",
            content: [
              { type: "input_text", text: "What is this?" },
              { type: "input_image", image_url: "data:image/png;base64,AAAA" },
            ],
          },
        ],
      },
      "Images are not supported: this model reads text only (`input[0].content[1]` is an `input_image` part). Send the content as input_text parts.",
      "unsupported_content",
    ],
  ])(
    "when the request sets %s, which is not served, then 400 naming it",
    async (param, extra, message, code) => {
      const { response, error } = await server.authorizedClient().POST("/v1/responses", {
        body: { model: MODEL, input: "Hi", ...extra } as never,
      });
      expect(response.status).toBe(400);
      expect(error).toEqual({ error: { message, type: "invalid_request_error", param, code } });
    },
  );
});

describe("OpenAI paths Arbor does not serve", () => {
  it.each([
    [
      "/v1/completions",
      "The legacy completions API (`/v1/completions`) is not served: use `/v1/chat/completions` or `/v1/responses`.",
    ],
    [
      "/v1/embeddings",
      "Embeddings (`/v1/embeddings`) are not served: Arbor serves chat models only, none that embeds.",
    ],
  ])(
    "when %s is called, then 404 in OpenAI's envelope says what is served instead",
    async (path, message) => {
      const response = await fetch(`${server.baseUrl}${path}`, {
        method: "POST",
        headers: { authorization: `Bearer ${server.adminKey}`, "content-type": "application/json" },
        body: JSON.stringify({ model: MODEL, input: "Hi", prompt: "Hi" }),
      });
      expect(response.status).toBe(404);
      expect(await response.json()).toEqual({
        error: { message, type: "not_found_error", param: null, code: "unknown_url" },
      });
    },
  );
});
