import { loadSpec, specOperations } from "@arbor/server";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { pendingOperations } from "./pending.ts";

const spec = loadSpec();
const operations = specOperations(spec);
let server: RunningServer;
beforeAll(async () => {
  server = await startServer();
});
afterAll(() => server.close());

describe("pending operations", () => {
  it("when the server is built, then exactly the listed operations have no handler", () => {
    expect([...server.pending].sort()).toEqual([...pendingOperations].sort());
  });

  const rows = operations.filter((op) => pendingOperations.includes(op.operationId));
  it.skipIf(rows.length === 0).each(rows.map((op) => [op.operationId, op]))(
    "when %s is called with its spec example, then 501 in its surface's envelope",
    async (_, op) => {
      const path = op.path
        .replace(/\{model\}/, "arbor%2Ftiny-chat")
        .replace(/\{[^}]+\}/g, "0193a0b6-0a1b-7c2d-8e3f-4a5b6c7d8e9f");
      const content = requestContent(op.path, op.method);
      const [mediaType, media] = Object.entries(content)[0] ?? [];
      const client = server.authorizedClient();
      const method = op.method.toUpperCase() as "GET";
      const init = media
        ? {
            body: media.example as never,
            headers: { "content-type": mediaType! },
            bodySerializer: (b: unknown) => (typeof b === "string" ? b : JSON.stringify(b)),
          }
        : {};
      const { response, error } = await client[method](path as never, init as never);
      expect(response.status, JSON.stringify(error)).toBe(501);
      if (op.path.startsWith("/call")) {
        expect(error).toEqual({ detail: `${op.operationId} is not implemented yet.` });
      } else {
        expect(error).toEqual({
          error: {
            message: `${op.operationId} is not implemented yet.`,
            type: "not_implemented_error",
            param: null,
            code: "not_implemented",
          },
        });
      }
    },
  );
});

type Media = Record<string, { example?: unknown }>;

/** The request media types of an operation, following a `$ref` to a shared request body. */
function requestContent(path: string, method: string): Media {
  const item = spec.paths[path]?.[method] as
    | { requestBody?: { $ref?: string; content?: Media } }
    | undefined;
  let body = item?.requestBody;
  if (body?.$ref) {
    const name = body.$ref.split("/").at(-1)!;
    body = (spec.components as { requestBodies: Record<string, { content: Media }> }).requestBodies[
      name
    ];
  }
  return body?.content ?? {};
}
