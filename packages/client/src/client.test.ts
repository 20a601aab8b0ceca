import { describe, expect, it } from "vitest";
import { createArborClient } from "./client.ts";
import {
  APIConnectionTimeoutError,
  APIError,
  APIUserAbortError,
  AuthenticationError,
  InternalServerError,
  NotFoundError,
  RateLimitError,
  unwrap,
} from "./errors.ts";

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

describe("chat.completions.create with stream: true", () => {
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
    const stream = await client.chat.completions.create({
      model: "m",
      messages: [{ role: "user", content: "hi" }],
      stream: true,
    });
    for await (const c of stream) {
      parts.push(c.choices[0]?.delta.content ?? "");
    }
    expect(parts).toEqual(["Hel", "lo"]);
    expect(sent).toMatchObject({ stream: true, model: "m" });
  });

  it("when the server keeps the stream open after [DONE], then the iteration still ends, and the body is cancelled", async () => {
    let cancelled = false;
    const client = createArborClient({
      baseUrl: base,
      fetch: async () => {
        const body = new ReadableStream<Uint8Array>({
          start(controller) {
            const line = `data: ${JSON.stringify({ id: "c", object: "chat.completion.chunk", created: 1, model: "m", choices: [{ index: 0, delta: { content: "x" }, finish_reason: null }] })}\n\ndata: [DONE]\n\n`;
            controller.enqueue(new TextEncoder().encode(line));
            // …and never closes.
          },
          cancel() {
            cancelled = true;
          },
        });
        return new Response(body, { headers: { "content-type": "text/event-stream" } });
      },
    });
    const stream = await client.chat.completions.create({
      model: "m",
      messages: [],
      stream: true,
    });
    const parts: string[] = [];
    for await (const c of stream) parts.push(c.choices[0]?.delta.content ?? "");
    expect(parts).toEqual(["x"]);
    expect(cancelled).toBe(true);
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
      const stream = await client.chat.completions.create({
        model: "m",
        messages: [],
        stream: true,
      });
      for await (const _ of stream) {
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
    await expect(
      client.chat.completions.create({ model: "m", messages: [], stream: true }),
    ).rejects.toBeInstanceOf(NotFoundError);
  });
});

describe("list methods", () => {
  const job = (id: string) => ({ id, object: "training_job" });
  const pages: Record<string, unknown> = {
    start: {
      object: "list",
      data: [job("a"), job("b")],
      first_id: "a",
      last_id: "b",
      has_more: true,
    },
    b: { object: "list", data: [job("c")], first_id: "c", last_id: "c", has_more: false },
  };

  it("when iterated with for await, then every item of every page is yielded once, asking with the last id", async () => {
    const urls: string[] = [];
    const client = createArborClient({
      baseUrl: base,
      fetch: async (r) => {
        urls.push(r.url);
        return json(pages[new URL(r.url).searchParams.get("after") ?? "start"]);
      },
    });
    const ids: string[] = [];
    for await (const item of client.training.jobs.list({ status: "running", limit: 2 }))
      ids.push(item.id);
    expect(ids).toEqual(["a", "b", "c"]);
    expect(urls).toEqual([
      `${base}/v1/preview/training-jobs?status=running&limit=2`,
      `${base}/v1/preview/training-jobs?status=running&limit=2&after=b`,
    ]);
  });

  it("when awaited, then it is one page, which leads to the next", async () => {
    const client = createArborClient({
      baseUrl: base,
      fetch: async (r) => json(pages[new URL(r.url).searchParams.get("after") ?? "start"]),
    });
    const page = await client.training.jobs.list();
    expect(page.data.map((j) => j.id)).toEqual(["a", "b"]);
    expect(page.hasNextPage()).toBe(true);
    const next = await page.nextPage();
    expect(next.data.map((j) => j.id)).toEqual(["c"]);
    expect(next.hasNextPage()).toBe(false);
    await expect(next.nextPage()).rejects.toThrow("no next page");
  });
});

/** Requests held by `hang`, as a real fetch holds them while it waits (undici's Request keeps
 * only a weak reference to what aborts it: an unreferenced one may be collected, unaborted). */
const held: Request[] = [];

/** A fetch that never answers, and rejects as fetch does when the request is aborted. */
function hang(r: Request): Promise<Response> {
  held.push(r);
  return new Promise((_, reject) => {
    if (r.signal.aborted) reject(r.signal.reason);
    r.signal.addEventListener("abort", () => reject(r.signal.reason));
  });
}

describe("request options", () => {
  it("when the answer's headers do not come within the timeout, then it is retried, then APIConnectionTimeoutError", async () => {
    let attempts = 0;
    const client = createArborClient({
      baseUrl: base,
      timeout: 20,
      sleep: async () => {},
      fetch: (r) => {
        attempts++;
        return hang(r);
      },
    });
    await expect(client.training.jobs.retrieve("j", { maxRetries: 1 })).rejects.toBeInstanceOf(
      APIConnectionTimeoutError,
    );
    expect(attempts).toBe(2);
  });

  it("when the caller aborts, then APIUserAbortError, with no retry", async () => {
    let attempts = 0;
    const client = createArborClient({
      baseUrl: base,
      fetch: (r) => {
        attempts++;
        return hang(r);
      },
    });
    const controller = new AbortController();
    const pending = client.models.retrieve("arbor/tiny-chat", { signal: controller.signal });
    controller.abort();
    await expect(pending).rejects.toBeInstanceOf(APIUserAbortError);
    expect(attempts).toBe(1);
  });

  it("when a request sets maxRetries and headers, then they hold for it alone", async () => {
    const seen: Request[] = [];
    const client = createArborClient({
      baseUrl: base,
      maxRetries: 3,
      sleep: async () => {},
      fetch: async (r) => {
        seen.push(r);
        return json({ error: { message: "busy" } }, 503);
      },
    });
    await expect(
      client.models.list({}, { maxRetries: 0, headers: { "x-trace": "t1" } }),
    ).rejects.toBeInstanceOf(InternalServerError);
    expect(seen).toHaveLength(1);
    expect(seen[0]!.headers.get("x-trace")).toBe("t1");
    await expect(client.models.list()).rejects.toBeInstanceOf(InternalServerError);
    expect(seen).toHaveLength(5);
  });
});

describe("training.datasets.create", () => {
  it.each([
    ["a string", (lines: string[]) => lines.join("\n")],
    [
      "objects from an async iterable",
      (lines: string[]) =>
        (async function* () {
          for (const line of lines) yield JSON.parse(line);
        })(),
    ],
    ["a Blob", (lines: string[]) => new Blob([lines.join("\n")])],
  ])("when given %s, then it uploads JSONL", async (_, make) => {
    const lines = [
      JSON.stringify({
        messages: [
          { role: "user", content: "a" },
          { role: "assistant", content: "b" },
        ],
      }),
      JSON.stringify({
        messages: [
          { role: "user", content: "c" },
          { role: "assistant", content: "d" },
        ],
      }),
    ];
    const sent: { type: string | null; body: string; url: string }[] = [];
    const client = createArborClient({
      baseUrl: base,
      fetch: async (r) => {
        sent.push({ type: r.headers.get("content-type"), body: await r.text(), url: r.url });
        return json({
          id: "d",
          object: "dataset",
          url: "dataset://d",
          name: "n",
          bytes: 1,
          lines: 2,
          created_at: 1,
        });
      },
    });
    const dataset = await client.training.datasets.create(make(lines), { name: "n" });
    expect(dataset.url).toBe("dataset://d");
    expect(sent).toEqual([
      {
        type: "application/jsonl",
        body: lines.join("\n"),
        url: `${base}/v1/preview/datasets?name=n`,
      },
    ]);
  });
});

describe("training.jobs.events.follow", () => {
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
    for await (const e of client.training.jobs.events.follow("job-1")) types.push(e.type);
    expect(types).toEqual(["training_started", "gradient_step", "gradient_step", "training_ended"]);
    expect(urls).toEqual([
      `${base}/v1/preview/training-jobs/job-1/events`,
      `${base}/v1/preview/training-jobs/job-1/events?after=e2`,
    ]);
  });
});
