import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { ArborClient } from "@arbor/client";
import { catalogModelDir, exportGguf, loadModel } from "@arbor/engine/model";
import { LlamaCppBackend } from "@arbor/server";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/** A user-supplied GGUF served by llama.cpp (the optional node-llama-cpp backend): here the
 * shipped model exported to GGUF. */
const GGUF_MODEL = "local/tiny-chat-gguf";
const dir = mkdtempSync(join(tmpdir(), "arbor-gguf-"));
let server: RunningServer;
let client: ArborClient;

const path = join(dir, "tiny-chat.gguf");
await exportGguf(await loadModel(catalogModelDir("arbor/tiny-chat")), path);
const backend = new LlamaCppBackend(path);
const available = await backend.load().then(
  () => true,
  (err: Error) => {
    console.log(
      `[contract] the llama.cpp backend cannot load here (${err.message}): its test is SKIPPED`,
    );
    return false;
  },
);

beforeAll(async () => {
  server = await startServer({}, { llama: new Map([[GGUF_MODEL, backend]]) });
  client = server.authorizedClient({ project: "default/gguf" });
});
afterAll(async () => {
  await server.close();
  rmSync(dir, { recursive: true, force: true });
});

describe.skipIf(!available)("llama.cpp backend", () => {
  it("when a GGUF model is configured, then it is listed and answers like the engine, with usage recorded", async () => {
    const { data } = await client.models.list();
    expect(data.map((m) => m.id)).toContain(GGUF_MODEL);
    const ask = async (model: string) =>
      await client.chat.completions.create({
        model,
        messages: [{ role: "user", content: "What is 7 + 5?" }],
        max_tokens: 12,
        temperature: 0,
      });
    const viaLlama = await ask(GGUF_MODEL);
    const viaEngine = await ask("arbor/tiny-chat");
    expect(viaLlama.model).toBe(GGUF_MODEL);
    expect(viaLlama.choices[0]!.message.content).toBe(viaEngine.choices[0]!.message.content);
    expect(viaLlama.usage.prompt_tokens).toBe(viaEngine.usage.prompt_tokens);
    const { calls } = await client.calls.query({
      project_id: "default/gguf",
      filter: { op_names: ["openai.chat.completions.create"] },
    });
    expect(calls.some((c) => c.display_name === GGUF_MODEL)).toBe(true);
  });

  it("when a field llama.cpp cannot honour is asked, then 400 naming it", async () => {
    const { response, error } = await client.POST("/v1/chat/completions", {
      body: {
        model: GGUF_MODEL,
        messages: [{ role: "user", content: "Hi" }],
        logprobs: true,
      },
    });
    expect(response.status).toBe(400);
    expect((error as { error: { code: string } }).error.code).toBe("unsupported_parameter");
  });
});
