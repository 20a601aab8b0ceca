import { connect } from "node:net";
import { gzipSync } from "node:zlib";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/** Requests malformed below the JSON level: charsets, encodings, nesting, raw HTTP. Each is a
 * 4xx in the surface's envelope with an `x-request-id`, never a 500. */
let server: RunningServer;
beforeAll(async () => {
  server = await startServer();
});
afterAll(() => server.close());

const send = (path: string, headers: Record<string, string>, body: string | Uint8Array) =>
  fetch(`${server.baseUrl}${path}`, {
    method: "POST",
    headers: { authorization: `Bearer ${server.adminKey}`, ...headers },
    body,
  });

const deep = (levels: number) => `{"a":${"[".repeat(levels)}${"]".repeat(levels)}}`;

describe("request bodies (createModel, getCallsUsage)", () => {
  it.each([
    ["an unsupported charset", { "content-type": "application/json; charset=latin1" }, "{}", 415],
    [
      "an unknown Content-Encoding",
      { "content-type": "application/json", "content-encoding": "zzz" },
      "{}",
      415,
    ],
    [
      "gzip on a plain body",
      { "content-type": "application/json", "content-encoding": "gzip" },
      "{}",
      400,
    ],
    ["nesting 5,000 deep", { "content-type": "application/json" }, deep(5000), 400],
  ])("when /v1 gets %s, then %i in OpenAI's envelope", async (_, headers, body, status) => {
    const response = await send("/v1/preview/models", headers, body);
    expect(response.status).toBe(status);
    expect(response.headers.get("x-request-id")).toBeTruthy();
    const json = (await response.json()) as { error: Record<string, unknown> };
    expect(json).toEqual({
      error: {
        message: expect.any(String),
        type: "invalid_request_error",
        param: null,
        code: expect.any(String),
      },
    });
  });

  it("when /calls gets nesting 5,000 deep, then 422 with the body's loc", async () => {
    const response = await send("/calls/usage", { "content-type": "application/json" }, deep(5000));
    expect(response.status).toBe(422);
    expect(await response.json()).toEqual({
      detail: [{ loc: ["body"], msg: expect.stringContaining("128"), type: "json_invalid" }],
    });
  });

  it("when a body is gzip-compressed properly, then it is read", async () => {
    const response = await send(
      "/calls/usage",
      { "content-type": "application/json", "content-encoding": "gzip" },
      gzipSync(JSON.stringify({ project_id: "default/p", call_ids: [] })),
    );
    expect(response.status).toBe(200);
  });

  it("when a body nests exactly 128 levels, then it is not refused for its depth", async () => {
    // 1 level for the top object, 127 arrays: the documented limit is inclusive.
    const response = await send("/calls/usage", { "content-type": "application/json" }, deep(127));
    expect(response.status).toBe(422);
    const detail = ((await response.json()) as { detail: { type: string }[] }).detail;
    expect(detail.map((d) => d.type)).not.toContain("json_invalid");
  });
});

describe("bodies over 1 MiB, parsed off the event loop (createChatCompletion)", () => {
  const big = (content: string, tail = "") =>
    `{"model":"arbor/tiny-chat","messages":[{"role":"user","content":${JSON.stringify(content)}}]${tail}}`;

  it("when a 2 MB body is valid JSON, then it is read (and refused for the context, not the JSON)", async () => {
    const response = await send(
      "/v1/chat/completions",
      { "content-type": "application/json" },
      big("a ".repeat(1_000_000)),
    );
    expect(response.status).toBe(400);
    expect(((await response.json()) as { error: { code: string } }).error.code).toBe(
      "context_length_exceeded",
    );
  });

  it.each([
    ["is not JSON", big("a".repeat(2_000_000)).slice(0, -1), "invalid_json"],
    [
      "nests 5,000 deep",
      big("a".repeat(2_000_000), `,"x":${"[".repeat(5000)}${"]".repeat(5000)}`),
      "invalid_json",
    ],
  ])("when a 2 MB body %s, then 400 %s", async (_, body, code) => {
    const response = await send(
      "/v1/chat/completions",
      { "content-type": "application/json" },
      body,
    );
    expect(response.status).toBe(400);
    expect(((await response.json()) as { error: { code: string } }).error.code).toBe(code);
  });

  it("when a 2 MB body names a charset other than UTF-8, then 415", async () => {
    const response = await send(
      "/v1/chat/completions",
      { "content-type": "application/json; charset=latin1" },
      big("a".repeat(2_000_000)),
    );
    expect(response.status).toBe(415);
  });
});

/** Writes raw bytes and reads the whole answer (the server closes the connection). */
function raw(request: string): Promise<string> {
  const { port } = new URL(server.baseUrl);
  return new Promise((resolve, reject) => {
    const socket = connect(Number(port), "127.0.0.1", () => socket.write(request));
    let answer = "";
    socket.on("data", (chunk) => {
      answer += chunk.toString("latin1");
    });
    socket.on("end", () => resolve(answer));
    socket.on("error", reject);
  });
}

describe("requests Node's HTTP parser refuses", () => {
  it.each([
    [
      "Content-Length: abc",
      "POST /v1/preview/models HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
      "error",
    ],
    [
      "Transfer-Encoding: gzip",
      "POST /calls/usage HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}",
      "detail",
    ],
  ])(
    "when a request has %s, then 400 in the envelope with an x-request-id",
    async (_, request, key) => {
      const answer = await raw(request);
      const [head, body] = answer.split("\r\n\r\n", 2) as [string, string];
      expect(head).toMatch(/^HTTP\/1\.1 400 /);
      expect(head).toMatch(/\r\nx-request-id: \S+/i);
      expect(Object.keys(JSON.parse(body))).toEqual([key]);
    },
  );
});
