import { describe, expect, it } from "vitest";
import { APIConnectionError } from "./errors.ts";
import { isRetryableRequest, retryDelayMs, retryingFetch, shouldRetryResponse } from "./retries.ts";

function scripted(answers: (Response | Error)[]) {
  const seen: Request[] = [];
  const fetch = async (request: Request) => {
    seen.push(request);
    const next = answers.shift();
    if (!next) throw new Error("no more answers");
    if (next instanceof Error) throw next;
    return next;
  };
  const sleeps: number[] = [];
  const sleep = async (ms: number) => {
    sleeps.push(ms);
  };
  return { fetch, seen, sleeps, sleep };
}

const url = "http://arbor.test";

describe("retryingFetch", () => {
  it("when a GET answers 503 then 200, then it retries once and returns the 200", async () => {
    const s = scripted([new Response("", { status: 503 }), new Response("ok")]);
    const fetch = retryingFetch({ maxRetries: 2, fetch: s.fetch, sleep: s.sleep, random: () => 0 });
    const res = await fetch(new Request(`${url}/v1/health`));
    expect(res.status).toBe(200);
    expect(s.seen).toHaveLength(2);
    expect(s.sleeps).toEqual([500]);
  });

  it("when every attempt fails, then it makes 1 + maxRetries attempts with growing backoff", async () => {
    const s = scripted([1, 2, 3].map(() => new Response("", { status: 500 })));
    const fetch = retryingFetch({ maxRetries: 2, fetch: s.fetch, sleep: s.sleep, random: () => 0 });
    const res = await fetch(new Request(`${url}/v1/health`));
    expect(res.status).toBe(500);
    expect(s.seen).toHaveLength(3);
    expect(s.sleeps).toEqual([500, 1000]);
  });

  it("when the body is sent again, then each attempt carries the whole body", async () => {
    const s = scripted([new Response("", { status: 429 }), new Response("{}")]);
    const fetch = retryingFetch({ maxRetries: 2, fetch: s.fetch, sleep: s.sleep, random: () => 0 });
    await fetch(new Request(`${url}/calls/usage`, { method: "POST", body: '{"a":1}' }));
    expect(await Promise.all(s.seen.map((r) => r.text()))).toEqual(['{"a":1}', '{"a":1}']);
  });

  it("when a create POST has no idempotency key, then it is never retried", async () => {
    const s = scripted([new Response("", { status: 503 })]);
    const fetch = retryingFetch({ maxRetries: 2, fetch: s.fetch, sleep: s.sleep, random: () => 0 });
    const res = await fetch(
      new Request(`${url}/v1/preview/models`, { method: "POST", body: "{}" }),
    );
    expect(res.status).toBe(503);
    expect(s.seen).toHaveLength(1);
  });

  it("when the connection fails on every attempt, then it throws APIConnectionError", async () => {
    const s = scripted([new Error("ECONNREFUSED"), new Error("ECONNREFUSED")]);
    const fetch = retryingFetch({ maxRetries: 1, fetch: s.fetch, sleep: s.sleep, random: () => 0 });
    await expect(fetch(new Request(`${url}/v1/health`))).rejects.toBeInstanceOf(APIConnectionError);
    expect(s.seen).toHaveLength(2);
  });

  it("when x-should-retry is false on a 503, then it does not retry", async () => {
    const s = scripted([new Response("", { status: 503, headers: { "x-should-retry": "false" } })]);
    const fetch = retryingFetch({ maxRetries: 2, fetch: s.fetch, sleep: s.sleep, random: () => 0 });
    expect((await fetch(new Request(`${url}/v1/health`))).status).toBe(503);
    expect(s.seen).toHaveLength(1);
  });
});

describe("retry policy", () => {
  it.each([
    [408, true],
    [409, true],
    [429, true],
    [500, true],
    [503, true],
    [400, false],
    [401, false],
    [404, false],
    [422, false],
  ])("when the status is %i, then shouldRetry is %s", (status, expected) => {
    expect(shouldRetryResponse(new Response(null, { status }))).toBe(expected);
  });

  it("when x-should-retry is true on a 400, then it retries", () => {
    expect(
      shouldRetryResponse(
        new Response(null, { status: 400, headers: { "x-should-retry": "true" } }),
      ),
    ).toBe(true);
  });

  it.each([
    [{ "retry-after-ms": "250" }, 250],
    [{ "retry-after": "2" }, 2000],
    [{ "retry-after": "120" }, 500], // beyond the 60 s cap: falls back to backoff
    [{ "retry-after": new Date(10_000 + 3000).toUTCString() }, 3000],
  ])("when the headers are %o, then the delay is %i ms", (headers, expected) => {
    const res = new Response(null, { status: 429, headers });
    expect(retryDelayMs(res, 0, () => 0, 10_000)).toBe(expected);
  });

  it("when backing off, then the delay doubles up to 8 s with at most 25% jitter", () => {
    expect([0, 1, 2, 3, 4, 5].map((n) => retryDelayMs(undefined, n, () => 0))).toEqual([
      500, 1000, 2000, 4000, 8000, 8000,
    ]);
    expect(retryDelayMs(undefined, 0, () => 1)).toBe(375);
  });

  it.each([
    ["GET", "/v1/models", {}, true],
    ["DELETE", "/v1/preview/models/x", {}, true],
    ["POST", "/calls/usage", {}, true],
    ["POST", "/v1/preview/models", {}, false],
    ["POST", "/v1/preview/models", { "idempotency-key": "k" }, true],
  ])("when %s %s, then retryable is %s", (method, path, headers, expected) => {
    expect(
      isRetryableRequest(
        new Request(`${url}${path}`, { method, headers, body: method === "POST" ? "{}" : null }),
      ),
    ).toBe(expected);
  });
});
