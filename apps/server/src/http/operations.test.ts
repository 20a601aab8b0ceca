import { describe, expect, it } from "vitest";
import { loadSpec, specOperations } from "./openapi.ts";
import { PUBLIC_OPERATIONS } from "./operations.ts";

describe("PUBLIC_OPERATIONS", () => {
  it("when the spec marks operations security: [], then they are exactly the public handlers' list", () => {
    const open = specOperations(loadSpec())
      .filter((op) => op.public)
      .map((op) => op.operationId)
      .sort();
    expect([...PUBLIC_OPERATIONS].sort()).toEqual(open);
  });
});
