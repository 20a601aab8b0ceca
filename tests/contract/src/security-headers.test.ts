import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/** Security headers on every kind of answer: the API's, the console's and the docs page's.
 * console.test.ts proves in Chromium that the pages' policies break neither page. */
let server: RunningServer;
beforeAll(async () => {
  server = await startServer();
});
afterAll(() => server.close());

const get = (path: string, headers: Record<string, string> = {}) =>
  fetch(`${server.baseUrl}${path}`, { headers, redirect: "manual" });

describe("security headers", () => {
  it.each([
    ["an API answer", "/v1/health", {}],
    ["an API error", "/v1/models", {}],
    ["the console", "/console/", {}],
    ["a console asset", "/console/favicon.svg", {}],
    ["the docs page", "/docs", { accept: "text/html" }],
    ["the spec", "/openapi.json", {}],
  ])(
    "when %s is fetched, then it is never framed, sniffed or given a referrer",
    async (_, path, headers) => {
      const response = await get(path, headers);
      expect(response.status).toBeLessThan(500);
      expect(response.headers.get("x-content-type-options")).toBe("nosniff");
      expect(response.headers.get("x-frame-options")).toBe("DENY");
      expect(response.headers.get("referrer-policy")).toBe("no-referrer");
      expect(response.headers.get("content-security-policy")).toMatch(/frame-ancestors 'none'/);
    },
  );

  it("when an API answer is fetched, then its policy lets it load nothing", async () => {
    const policy = (await get("/v1/health")).headers.get("content-security-policy");
    expect(policy).toMatch(/default-src 'none'/);
  });

  it("when the console or the docs page is fetched, then scripts come from the server itself (the docs' inline ones by hash), never inline at will", async () => {
    const console = (await get("/console/")).headers.get("content-security-policy")!;
    expect(console).toMatch(/script-src 'self'(;|$)/);
    expect(console).not.toMatch(/unsafe/);
    const docs = (await get("/docs", { accept: "text/html" })).headers.get(
      "content-security-policy",
    )!;
    expect(docs).toMatch(/script-src 'self'( 'sha256-[A-Za-z0-9+/=]+')+/);
    expect(docs).not.toMatch(/script-src[^;]*unsafe/);
  });
});
