import { describe, expect, it } from "vitest";
import { createArborClient } from "./client.ts";
import { APIError, AuthenticationError, NotFoundError, RateLimitError, unwrap } from "./errors.ts";

const base = "http://arbor.test";

function sse(events: unknown[], headers: Record<string, string> = {}): Response {
  const body = events
    .map((e) => `data: ${typeof e === "string" ? e : JSON.stringify(e)}\n\n`)
    .join("");
  return new Response(body, { headers: { "content-type": "text/event-stream", ...headers } });
}

function json(body: unknown, status = 200, headers: Record<string, string> = {}): Response {
  return new Response(JSON.stringify(body), {
    status,
    headers: { "content-type": "application/json", ...headers },
  });
}

describe("createArborClient", () => {
  it("when a request goes out, then it carries the key, the project and a request id", async () => {
    const seen: Request[] = [];
    const client = createArborClient({
      baseUrl: `${base}/`,
      apiKey: "sk-arb-x",
      project: "acme/bot",
      fetch: async (r) => {
        seen.push(r);
        return json({ status: "ok" });
      },
    });
    await client.GET("/v1/health");
    expect(seen[0]!.url).toBe(`${base}/v1/health`);
    expect(seen[0]!.headers.get("authorization")).toBe("Bearer sk-arb-x");
    expect(seen[0]!.headers.get("compat-project")).toBe("acme/bot");
    expect(seen[0]!.headers.get("x-request-id")).toMatch(/^[0-9a-f-]{36}$/);
  });

  it.each([
    [401, AuthenticationError],
    [404, NotFoundError],
    [429, RateLimitError],
  ])(
    "when the server answers %i, then unwrap throws its class with status, request id and body",
    async (status, Class) => {
      const body = { error: { message: "nope", type: "x", param: null, code: "c" } };
      const client = createArborClient({
        baseUrl: base,
        maxRetries: 0,
        fetch: async () => json(body, status, { "x-request-id": "rid" }),
      });
      const result = await client.GET("/v1/models");
      let e: unknown;
      try {
        unwrap(result);
      } catch (thrown) {
        e = thrown;
      }
      expect(e).toBeInstanceOf(Class);
      expect(e).toBeInstanceOf(APIError);
      expect((e as APIError).status).toBe(status);
      expect((e as APIError).requestId).toBe("rid");
      expect((e as APIError).code).toBe("c");
      expect((e as APIError).message).toBe(`${status} nope`);
    },
  );

  it("when a /calls error has a detail list, then the message names each location", () => {
    const e = APIError.from(
      422,
      { detail: [{ loc: ["body", "limit"], msg: "too small", type: "t" }] },
      new Headers(),
    );
    expect(e.message).toBe("422 body.limit: too small");
  });
});

describe("streamChatCompletion", () => {
  it("when the server streams chunks, then each is yielded until [DONE]", async () => {
    const chunk = (content: string) => ({
      id: "c",
      object: "chat.completion.chunk",
      created: 1,
      model: "m",
      choices: [{ index: 0, delta: { content }, finish_reason: null }],
    });
    let sent: unknown;
    const client = createArborClient({
      baseUrl: base,
      fetch: async (r) => {
        sent = await r.json();
        return sse([chunk("Hel"), chunk("lo"), "[DONE]", chunk("never")]);
      },
    });
    const parts: string[] = [];
    for await (const c of client.streamChatCompletion({
      model: "m",
      messages: [{ role: "user", content: "hi" }],
    })) {
      parts.push(c.choices[0]?.delta.content ?? "");
    }
    expect(parts).toEqual(["Hel", "lo"]);
    expect(sent).toMatchObject({ stream: true, model: "m" });
  });

  it("when an error event arrives after the headers, then it is thrown", async () => {
    const client = createArborClient({
      baseUrl: base,
      fetch: async () =>
        sse([
          { error: { message: "engine failed", type: "server_error", param: null, code: null } },
        ]),
    });
    const iterate = async () => {
      for await (const _ of client.streamChatCompletion({ model: "m", messages: [] })) {
        // drain
      }
    };
    await expect(iterate()).rejects.toThrow("engine failed");
  });

  it("when the request is refused before streaming, then the status's error class is thrown", async () => {
    const client = createArborClient({
      baseUrl: base,
      fetch: async () =>
        json(
          {
            error: {
              message: "Unknown model",
              type: "not_found_error",
              param: "model",
              code: "model_not_found",
            },
          },
          404,
        ),
    });
    const iterate = async () => {
      for await (const _ of client.streamChatCompletion({ model: "m", messages: [] })) {
        // drain
      }
    };
    await expect(iterate()).rejects.toBeInstanceOf(NotFoundError);
  });
});

describe("paginate", () => {
  it("when pages follow each other, then every item is yielded once, asking with the last id", async () => {
    const afters: (string | undefined)[] = [];
    const pages: Record<string, { data: { id: string }[]; has_more: boolean }> = {
      start: { data: [{ id: "a" }, { id: "b" }], has_more: true },
      b: { data: [{ id: "c" }], has_more: false },
    };
    const client = createArborClient({ baseUrl: base, fetch: async () => json({}) });
    const ids: string[] = [];
    for await (const item of client.paginate(async (after) => {
      afters.push(after);
      return { data: pages[after ?? "start"], response: new Response(null, { status: 200 }) };
    })) {
      ids.push(item.id);
    }
    expect(ids).toEqual(["a", "b", "c"]);
    expect(afters).toEqual([undefined, "b"]);
  });
});

describe("followTrainingJob", () => {
  const event = (id: string, type: string) => ({
    id,
    object: "training_job.event",
    type,
    data: {},
    created_at: 1,
  });

  it("when the stream drops before the end, then it reconnects after the last event and stops at the terminal one", async () => {
    const urls: string[] = [];
    const answers = [
      sse([event("e1", "training_started"), event("e2", "gradient_step")]),
      sse([
        event("e3", "gradient_step"),
        event("e4", "training_ended"),
        event("e5", "gradient_step"),
      ]),
    ];
    const client = createArborClient({
      baseUrl: base,
      fetch: async (r) => {
        urls.push(r.url);
        expect(r.headers.get("accept")).toBe("text/event-stream");
        return answers.shift()!;
      },
      sleep: async () => {},
    });
    const types: string[] = [];
    for await (const e of client.followTrainingJob("job-1")) types.push(e.type);
    expect(types).toEqual(["training_started", "gradient_step", "gradient_step", "training_ended"]);
    expect(urls).toEqual([
      `${base}/v1/preview/training-jobs/job-1/events`,
      `${base}/v1/preview/training-jobs/job-1/events?after=e2`,
    ]);
  });
});
