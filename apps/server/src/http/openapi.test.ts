import express from "express";
import { describe, expect, it } from "vitest";
import { loadSpec, type OpenApiDocument, specOperations } from "./openapi.ts";

describe("specOperations", () => {
  const spec: OpenApiDocument = {
    openapi: "3.1.0",
    info: { title: "t", version: "0" },
    paths: {
      "/v1/runs:resolve": { post: { operationId: "resolveRun" } },
      "/v1/runs/{run_id}": { get: { operationId: "retrieveRun" } },
      "/v1/runs/{run_id}:close": { post: { operationId: "closeRun" } },
    },
  };

  it("when a path has a literal colon, then its Express path escapes it and keeps the parameters", () => {
    expect(specOperations(spec).map((op) => op.expressPath)).toEqual([
      "/v1/runs\\:resolve",
      "/v1/runs/:run_id",
      "/v1/runs/:run_id\\:close",
    ]);
  });

  it("when every operation of the bundled spec is routed, then Express takes each path", () => {
    const router = express.Router({ strict: true });
    for (const op of specOperations(loadSpec())) {
      expect(() => router[op.method](op.expressPath, (_req, res) => res.end())).not.toThrow();
    }
  });
});
