import { describe, expect, it } from "vitest";
import { servesPath } from "./app.ts";

describe("servesPath", () => {
  it.each([
    ["training", "/v1/preview/models", true],
    ["training", "/v1/training/runs/{run_id}:close", true],
    ["training", "/v1/chat/completions", true],
    ["training", "/v1/models", false],
    ["training", "/calls/usage", false],
    ["inference", "/v1/models/{model}", true],
    ["inference", "/v1/chat/completions/", true],
    ["inference", "/v1/preview/models", false],
    ["inference", "/v1/training/runs:resolve", false],
    ["training", "/v1/files/{file_id}", true],
    ["training", "/v1/fine_tuning/jobs", true],
    ["inference", "/v1/fine_tuning/jobs", false],
    ["calls", "/v1/files", false],
    ["calls", "/call/start", true],
    ["calls", "/v1/chat/completions", false],
    ["calls", "/v1/health", true],
  ] as const)("when the role is %s, then %s is served: %s", (role, path, expected) => {
    expect(servesPath(role, path)).toBe(expected);
  });
});
