import { cpSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { type ArborClient, type ChatCompletionChunk, RateLimitError, unwrap } from "@arbor/client";
import { catalogModelDir } from "@arbor/engine/model";
import { loadSpec } from "@arbor/server";
import { Ajv2020 } from "ajv/dist/2020.js";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { PATIENT } from "../../../vitest.shared.ts";
import { type RunningServer, startServer } from "./harness.ts";

const MODEL = "arbor/tiny-chat";
const ask = (content: string) => [{ role: "user" as const, content }];
/** A tool small enough for tiny-chat's 256-token context, its call included. */
const clock = {
  type: "function" as const,
  function: {
    name: "time",
    parameters: { type: "object", properties: { tz: { type: "string" } }, required: ["tz"] },
  },
};

let server: RunningServer;
let client: ArborClient;
beforeAll(async () => {
  server = await startServer();
  client = server.authorizedClient();
});
afterAll(() => server.close());

const ajv = new Ajv2020({ strict: false, validateFormats: false });
ajv.addSchema({ ...loadSpec(), $id: "spec" });
const validChunk = ajv.getSchema("spec#/components/schemas/ChatCompletionChunk")!;

async function collect(stream: AsyncIterable<ChatCompletionChunk>): Promise<ChatCompletionChunk[]> {
  const chunks: ChatCompletionChunk[] = [];
  for await (const chunk of stream) {
    expect(validChunk(chunk), JSON.stringify(validChunk.errors)).toBe(true);
    chunks.push(chunk);
  }
  return chunks;
}

describe("listModels", () => {
  it("when listed, then the shipped base model is there with root = id and owner system", async () => {
    const list = unwrap(await client.GET("/v1/models"));
    expect(list.object).toBe("list");
    expect(list.data).toContainEqual({
      id: MODEL,
      object: "model",
      created: expect.any(Number),
      owned_by: "system",
      root: MODEL,
      parent: null,
    });
  });
});

describe("retrieveModel", () => {
  it.each([
    ["percent-encoded", encodeURIComponent(MODEL)],
    ["raw", MODEL],
  ])("when the id is sent %s, then the model comes back", async (_, path) => {
    const response = await fetch(`${server.baseUrl}/v1/models/${path}`, {
      headers: { authorization: `Bearer ${server.adminKey}` },
    });
    expect(response.status).toBe(200);
    expect(await response.json()).toMatchObject({ id: MODEL, root: MODEL });
  });

  it("when the model is unknown, then 404 model_not_found", async () => {
    const { response, error } = await client.GET("/v1/models/{model}", {
      params: { path: { model: "nobody/nothing" } },
    });
    expect(response.status).toBe(404);
    expect(error).toEqual({
      error: {
        message: 'The model "nobody/nothing" does not exist or you do not have access to it.',
        type: "not_found_error",
        param: "model",
        code: "model_not_found",
      },
    });
  });
});

describe("createChatCompletion", () => {
  it("when asked, then it answers a chat.completion whose usage adds up", async () => {
    const completion = await client.chat.completions.create({
      model: MODEL,
      messages: ask("What is 2 + 3?"),
      max_tokens: 24,
      temperature: 0,
    });
    expect(completion).toMatchObject({
      object: "chat.completion",
      model: MODEL,
      system_fingerprint: expect.stringMatching(/^fp_/),
    });
    expect(completion.id).toMatch(/^chatcmpl-/);
    const [choice] = completion.choices;
    expect(choice).toMatchObject({ index: 0, message: { role: "assistant" }, logprobs: null });
    expect(choice!.message.content!.length).toBeGreaterThan(0);
    expect(["stop", "length"]).toContain(choice!.finish_reason);
    expect(completion.usage.total_tokens).toBe(
      completion.usage.prompt_tokens + completion.usage.completion_tokens,
    );
    expect(completion.usage.completion_tokens).toBeGreaterThan(0);
    expect(completion.usage.completion_tokens).toBeLessThanOrEqual(24);
  });

  it("when the same seed is sent twice, then the output is the same; another seed may differ", async () => {
    const body = {
      model: MODEL,
      messages: ask("Say hello."),
      max_tokens: 16,
      temperature: 1,
      seed: 1234,
    };
    const a = await client.chat.completions.create(body);
    const b = await client.chat.completions.create(body);
    expect(b.choices[0]!.message.content).toBe(a.choices[0]!.message.content);
  });

  it("when max_tokens is reached, then finish_reason is length", async () => {
    const completion = await client.chat.completions.create({
      model: MODEL,
      messages: ask("Count to twenty."),
      max_completion_tokens: 2,
      temperature: 0,
    });
    expect(completion.choices[0]!.finish_reason).toBe("length");
    expect(completion.usage.completion_tokens).toBe(2);
  });

  it("when n is 3, then three choices come back, each indexed", async () => {
    const completion = await client.chat.completions.create({
      model: MODEL,
      messages: ask("Hi!"),
      n: 3,
      max_tokens: 8,
      seed: 7,
    });
    expect(completion.choices.map((c) => c.index)).toEqual([0, 1, 2]);
  });

  it("when logprobs are asked with 5 alternatives, then every token carries them", async () => {
    const completion = await client.chat.completions.create({
      model: MODEL,
      messages: ask("Hi!"),
      max_tokens: 6,
      logprobs: true,
      top_logprobs: 5,
      temperature: 0,
    });
    const content = completion.choices[0]!.logprobs!.content!;
    expect(content).toHaveLength(completion.usage.completion_tokens);
    for (const token of content) {
      expect(token.logprob).toBeLessThanOrEqual(0);
      expect(token.top_logprobs).toHaveLength(5);
      expect(token.top_logprobs[0]!.logprob).toBeGreaterThanOrEqual(token.top_logprobs[4]!.logprob);
    }
  });

  it("when response_format is json_object, then the content parses as JSON", async () => {
    const completion = await client.chat.completions.create({
      model: MODEL,
      messages: ask("Give me a JSON object."),
      response_format: { type: "json_object" },
      max_tokens: 64,
      seed: 3,
    });
    expect(() => JSON.parse(completion.choices[0]!.message.content!)).not.toThrow();
  });

  it("when a stop string is given, then the output does not contain it", async () => {
    const completion = await client.chat.completions.create({
      model: MODEL,
      messages: ask("What is 2 + 3?"),
      stop: ["="],
      max_tokens: 24,
      temperature: 0,
    });
    expect(completion.choices[0]!.message.content).not.toContain("=");
  });

  it("when OpenAI's bookkeeping fields and a message name are sent, then it answers, and metadata, user and safety_identifier are on the recorded call", async () => {
    const project = "default/bookkeeping";
    const completion = await server.authorizedClient({ project }).chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "Hi", name: "ada" }],
      max_tokens: 2,
      store: false,
      metadata: { run: "r-7", stage: "eval" },
      service_tier: "auto",
      prompt_cache_key: "k-1",
      safety_identifier: "sid-9",
      user: "u-42",
      verbosity: "medium",
      reasoning_effort: "none",
      parallel_tool_calls: false,
    });
    expect(completion.choices[0]!.message.role).toBe("assistant");
    const { calls } = await client.calls.query({ project_id: project });
    expect(calls).toHaveLength(1);
    expect(calls[0]!.attributes).toEqual({
      user: "u-42",
      safety_identifier: "sid-9",
      metadata: { run: "r-7", stage: "eval" },
    });
  });

  it.each([
    [
      "verbosity",
      { verbosity: "low" },
      '`verbosity` "low" is not supported by this model, which has no verbosity setting (send "medium", OpenAI\'s default, or leave it out).',
    ],
    [
      "reasoning_effort",
      { reasoning_effort: "high" },
      '`reasoning_effort` "high" is not supported by this model, which has no reasoning-effort setting (send "none", or leave it out).',
    ],
  ])("when %s asks for what the model lacks, then 400 naming it", async (param, extra, message) => {
    const { response, error } = await client.POST("/v1/chat/completions", {
      body: { model: MODEL, messages: ask("Hi"), ...extra } as never,
    });
    expect(response.status).toBe(400);
    expect(error).toEqual({
      error: { message, type: "invalid_request_error", param, code: "unsupported_parameter" },
    });
  });

  it("when a message carries an image, then 400 says images are not supported, naming the part", async () => {
    const { response, error } = await client.POST("/v1/chat/completions", {
      body: {
        model: MODEL,
        messages: [
          {
            role: "user",
            content: [
              { type: "text", text: "What is this?" },
              { type: "image_url", image_url: { url: "data:image/png;base64,AAAA" } },
            ],
          },
        ],
      } as never,
    });
    expect(response.status).toBe(400);
    expect(error).toEqual({
      error: {
        message:
          "Images are not supported: this model reads text only (`messages[0].content[1]` is an `image_url` part). Send the content as text parts.",
        type: "invalid_request_error",
        param: "messages[0].content[1]",
        code: "unsupported_content",
      },
    });
  });

  it("when logit_bias is set, then 400 naming it", async () => {
    const { response, error } = await client.POST("/v1/chat/completions", {
      body: { model: MODEL, messages: ask("Hi"), logit_bias: { "1": 5 } } as never,
    });
    expect(response.status).toBe(400);
    expect(error).toEqual({
      error: {
        message: "`logit_bias` is not supported by this model.",
        type: "invalid_request_error",
        param: "logit_bias",
        code: "unsupported_parameter",
      },
    });
  });

  it.each([
    ["tool_choice without tools", { tool_choice: "auto" }, "tool_choice"],
    [
      "tool_choice naming an undeclared function",
      { tools: [clock], tool_choice: { type: "function", function: { name: "date" } } },
      "tool_choice",
    ],
    ["a function declared twice", { tools: [clock, clock] }, "tools[1].function.name"],
    [
      "a strict function whose schema cannot be enforced",
      {
        tools: [
          {
            type: "function",
            function: {
              name: "f",
              strict: true,
              parameters: { type: "object", properties: { n: { type: "integer", minimum: 1 } } },
            },
          },
        ],
      },
      "tools[0].function.parameters.properties.n.minimum",
    ],
    [
      "a tool call's arguments that are not text",
      {
        messages: [
          { role: "user", content: "Hi" },
          {
            role: "assistant",
            content: null,
            tool_calls: [
              { id: "call_1", type: "function", function: { name: "f", arguments: {} } },
            ],
          },
        ],
      },
      "messages[1].tool_calls[0].function.arguments",
    ],
  ])(
    "when a request has %s, then 400 naming the field in OpenAI's envelope",
    async (_, extra, param) => {
      const { response, error } = await client.POST("/v1/chat/completions", {
        body: { model: MODEL, messages: ask("Hi"), ...extra } as never,
      });
      expect(response.status).toBe(400);
      expect(error).toMatchObject({ error: { type: "invalid_request_error", param } });
    },
  );

  it("when tools are offered and the reply is not a call, then it is plain content; a named function is always called", async () => {
    const auto = await client.chat.completions.create({
      model: MODEL,
      messages: ask("What is 2 + 3?"),
      tools: [clock],
      max_tokens: 12,
      temperature: 0,
    });
    // The untrained model answers in text: no call, no 500.
    expect(auto.choices[0]!.message.tool_calls).toBeUndefined();
    expect(["stop", "length"]).toContain(auto.choices[0]!.finish_reason);
    const named = await client.chat.completions.create({
      model: MODEL,
      messages: ask("Time?"),
      tools: [clock],
      tool_choice: { type: "function", function: { name: "time" } },
      max_tokens: 64,
      temperature: 0,
    });
    const [choice] = named.choices;
    // The untrained model's zone may run to the token limit: the call is closed in time.
    expect(["tool_calls", "length"]).toContain(choice!.finish_reason);
    expect(choice!.message.content).toBeNull();
    expect(choice!.message.tool_calls).toEqual([
      {
        id: expect.stringMatching(/^call_/),
        type: "function",
        function: { name: "time", arguments: expect.any(String) },
      },
    ]);
    const args = JSON.parse(choice!.message.tool_calls![0]!.function.arguments);
    expect(Object.keys(args)).toEqual(["tz"]);
    expect(typeof args.tz).toBe("string");

    // A call and its answer render with the model's template when the conversation goes on.
    const next = await client.chat.completions.create({
      model: MODEL,
      messages: [
        ...ask("Time?"),
        {
          role: "assistant",
          content: null,
          tool_calls: [
            {
              id: "call_1",
              type: "function",
              function: { name: "time", arguments: '{"tz":"UTC"}' },
            },
          ],
        },
        { role: "tool", tool_call_id: "call_1", content: "12:00" },
      ],
      max_tokens: 4,
      temperature: 0,
    });
    expect(typeof next.choices[0]!.message.content).toBe("string");
  });

  it("when a named call is streamed, then its deltas come as OpenAI sends them, validate against the spec, and the call is recorded with its usage", async () => {
    const project = "default/tool-calls";
    const chunks = await collect(
      await server.authorizedClient({ project }).chat.completions.create({
        model: MODEL,
        messages: ask("Time?"),
        tools: [clock],
        tool_choice: { type: "function", function: { name: "time" } },
        max_tokens: 64,
        temperature: 0,
        stream: true,
      }),
    );
    const pieces = chunks.flatMap((c) => c.choices.flatMap((ch) => ch.delta.tool_calls ?? []));
    expect(pieces[0]).toEqual({
      index: 0,
      id: expect.stringMatching(/^call_/),
      type: "function",
      function: { name: "time", arguments: "" },
    });
    const args = pieces
      .slice(1)
      .map((p) => p.function?.arguments ?? "")
      .join("");
    expect(typeof JSON.parse(args).tz).toBe("string");
    expect(["tool_calls", "length"]).toContain(chunks.at(-1)!.choices[0]!.finish_reason);
    const { calls } = await client.calls.query({ project_id: project });
    expect(calls).toHaveLength(1);
    expect(calls[0]!.output).toMatchObject({
      choices: [
        {
          message: {
            content: null,
            tool_calls: [{ id: pieces[0]!.id, function: { name: "time", arguments: args } }],
          },
        },
      ],
    });
    expect(calls[0]!.summary.usage?.[MODEL]).toMatchObject({ requests: 1 });
  });

  it("when the model is unknown, then 404 model_not_found", async () => {
    const { response, error } = await client.POST("/v1/chat/completions", {
      body: {
        model: "acme/none",
        messages: ask("Hi"),
      },
    });
    expect(response.status).toBe(404);
    expect((error as { error: { code: string } }).error.code).toBe("model_not_found");
  });

  it("when streamed with include_usage, then role first, one finish per choice, usage last", async () => {
    const chunks = await collect(
      await client.chat.completions.create({
        model: MODEL,
        messages: ask("What is 4 + 4?"),
        n: 2,
        max_tokens: 12,
        seed: 5,
        stream_options: { include_usage: true },
        stream: true,
      }),
    );
    for (const index of [0, 1]) {
      const mine = chunks.filter((c) => c.choices[0]?.index === index);
      expect(mine[0]!.choices[0]!.delta).toEqual({ role: "assistant", content: "" });
      expect(mine.filter((c) => c.choices[0]!.finish_reason !== null)).toHaveLength(1);
      expect(mine.at(-1)!.choices[0]!.finish_reason).not.toBeNull();
    }
    const last = chunks.at(-1)!;
    expect(last.choices).toEqual([]);
    expect(last.usage!.total_tokens).toBe(
      last.usage!.prompt_tokens + last.usage!.completion_tokens,
    );
    const streamed = chunks
      .filter((c) => c.choices[0]?.index === 0)
      .map((c) => c.choices[0]!.delta.content ?? "")
      .join("");
    const whole = await client.chat.completions.create({
      model: MODEL,
      messages: ask("What is 4 + 4?"),
      n: 2,
      max_tokens: 12,
      seed: 5,
    });
    expect(streamed).toBe(whole.choices[0]!.message.content);
  });

  it("when the client disconnects mid-stream, then the engine stops and the call is recorded as cancelled", async () => {
    const project = "default/disconnect";
    const controller = new AbortController();
    const stream = await server.authorizedClient({ project }).chat.completions.create(
      {
        model: MODEL,
        // 8 choices of up to 200 tokens: far more work than the first chunk takes to arrive.
        messages: ask("Tell me a long story."),
        n: 8,
        max_tokens: 200,
        temperature: 1,
        seed: 9,
        stream: true,
      },
      { signal: controller.signal },
    );
    for await (const _ of stream) {
      controller.abort();
      break;
    }
    const [engine] = await server.engines.loaded();
    await vi.waitFor(async () => expect((await engine!.stats()).activeSequences).toBe(0), PATIENT);
    await vi.waitFor(async () => {
      const { calls } = await client.calls.query({ project_id: project });
      expect(calls).toHaveLength(1);
      expect(calls[0]!.exception).toMatch(/cancelled/);
      const usage = (calls[0]!.summary.usage as Record<string, { completion_tokens: number }>)[
        MODEL
      ]!;
      expect(usage.completion_tokens).toBeLessThan(8 * 200);
    }, PATIENT);
  });

  it("when a request names a project and a trace, then its usage is a call nested in that trace", async () => {
    const project = "default/traced";
    await client.calls.start({
      start: {
        project_id: project,
        id: "agent-run",
        trace_id: "trace-1",
        op_name: "agent",
        started_at: new Date().toISOString(),
      },
    });
    const completion = await server
      .authorizedClient({
        project,
        headers: { "Arbor-Trace-Id": "trace-1", "Arbor-Parent-Call-Id": "agent-run" },
      })
      .chat.completions.create({ model: MODEL, messages: ask("Hi"), max_tokens: 4, user: "u-42" });
    const usage = await client.calls.usage({ project_id: project, call_ids: ["agent-run"] });
    expect(usage.call_usage["agent-run"]).toEqual({
      [MODEL]: expect.objectContaining({
        requests: 1,
        prompt_tokens: completion.usage.prompt_tokens,
        completion_tokens: completion.usage.completion_tokens,
        total_tokens: completion.usage.total_tokens,
      }),
    });
    const { calls } = await client.calls.query({
      project_id: project,
      filter: { parent_ids: ["agent-run"] },
    });
    expect(calls[0]).toMatchObject({
      op_name: "openai.chat.completions.create",
      trace_id: "trace-1",
      attributes: { user: "u-42" },
    });
  });

  it("when no project header is sent, then usage goes to <default entity>/inference", async () => {
    await client.chat.completions.create({ model: MODEL, messages: ask("Hi"), max_tokens: 2 });
    const { calls } = await client.calls.query({ project_id: "default/inference" });
    expect(calls.length).toBeGreaterThan(0);
  });
});

describe("createChatCompletionTrailingSlash", () => {
  it("when the trailing-slash path is used, then it answers like the main one", async () => {
    const { data, response } = await client.POST("/v1/chat/completions/", {
      body: { model: MODEL, messages: ask("Hi"), max_tokens: 3, temperature: 0 },
    });
    expect(response.status).toBe(200);
    expect(data).toMatchObject({ object: "chat.completion", model: MODEL });
  });
});

describe("rate limits", () => {
  it("when a key exceeds its requests per minute, then 429 RateLimitError with Retry-After and x-ratelimit headers", async () => {
    const limited = await startServer({ rateLimits: { keyRequestsPerMinute: 1 } });
    try {
      const c = limited.authorizedClient();
      const first = await c.POST("/v1/chat/completions", {
        body: {
          model: MODEL,
          messages: ask("Hi"),
          max_tokens: 1,
        },
      });
      expect(first.response.status).toBe(200);
      expect(first.response.headers.get("x-ratelimit-limit-requests")).toBe("1");
      const second = await c.POST("/v1/chat/completions", {
        body: {
          model: MODEL,
          messages: ask("Hi"),
          max_tokens: 1,
        },
      });
      expect(second.response.status).toBe(429);
      expect(Number(second.response.headers.get("retry-after"))).toBeGreaterThan(0);
      expect(second.response.headers.get("x-ratelimit-remaining-requests")).toBe("0");
      expect(second.error).toEqual({
        error: {
          message: expect.stringContaining("1 requests per minute"),
          type: "rate_limit_error",
          param: null,
          code: "rate_limit_exceeded",
        },
      });
      expect(() => unwrap(second)).toThrow(RateLimitError);
    } finally {
      await limited.close();
    }
  });
});

describe("continuous batching through the server", () => {
  it("when requests arrive together, then they share the engine's forward passes", async () => {
    const fresh = await startServer();
    try {
      const c = fresh.authorizedClient();
      await Promise.all(
        Array.from({ length: 6 }, (_, i) =>
          c.POST("/v1/chat/completions", {
            body: {
              model: MODEL,
              messages: ask(`What is ${i} + 1?`),
              max_tokens: 16,
              temperature: 0,
            },
          }),
        ),
      );
      const [engine] = await fresh.engines.loaded();
      expect((await engine!.stats()).maxBatch).toBeGreaterThan(1);
    } finally {
      await fresh.close();
    }
  });
});

describe("long prompts on a long-context model", () => {
  it("when a 100,000-letter word's prompt is being served, then a 5 KB chat sent after it is answered first", async () => {
    const fresh = await startServer();
    try {
      // tiny-chat with Llama 3.1's context: the word fits, so it is tokenized and prefilled.
      const id = "acme/tiny-chat-128k";
      const dir = join(fresh.dataDir, "models", id);
      cpSync(catalogModelDir(MODEL), dir, { recursive: true });
      const config = JSON.parse(readFileSync(join(dir, "config.json"), "utf8"));
      writeFileSync(
        join(dir, "config.json"),
        JSON.stringify({ ...config, max_position_embeddings: 131_072 }),
      );
      await fresh.engines.refresh();
      const c = fresh.authorizedClient();
      let seed = 7;
      const word = Array.from({ length: 100_000 }, () => {
        seed = (seed * 1103515245 + 12345) % 2 ** 31;
        return String.fromCharCode(97 + (seed % 26));
      }).join("");
      const order: string[] = [];
      const controller = new AbortController();
      const long = c
        .POST("/v1/chat/completions", {
          body: { model: id, messages: ask(word), max_tokens: 1, temperature: 0 },
          signal: controller.signal,
        })
        .then(() => order.push("long"))
        .catch(() => order.push("long cancelled"));
      const engine = await fresh.engines.engine(id);
      await vi.waitFor(
        async () => expect((await engine.stats()).steps).toBeGreaterThan(0),
        PATIENT,
      );
      const { response, data } = await c.POST("/v1/chat/completions", {
        body: {
          model: id,
          messages: ask("Hello there, how are you today? ".repeat(160)),
          max_tokens: 4,
          temperature: 0,
        },
      });
      order.push("short");
      expect(response.status).toBe(200);
      expect(data!.usage!.prompt_tokens).toBeGreaterThan(1000);
      controller.abort();
      await long;
      expect(order).toEqual(["short", "long cancelled"]);
      // The client left: the engine drops the long prompt.
      await vi.waitFor(async () => expect((await engine.stats()).activeSequences).toBe(0), PATIENT);
    } finally {
      await fresh.close();
    }
  });
});
