import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import { join } from "node:path";
import type { ArborClient } from "@arbor/client";
import {
  type HubStandin,
  shippedModelFiles,
  startHubStandin,
} from "@arbor/engine/test/hub-standin";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/**
 * `POST /v1/preview/base-models/pull` end to end: the server pointed at a stand-in Hub by
 * HF_ENDPOINT (the real Hub is not reachable from the machines that test Arbor), an operator pulls
 * the shipped tiny-chat's files from it as a base model, and a chat is answered by it.
 */
const tiny = shippedModelFiles();
const sha256 = (bytes: Uint8Array) => createHash("sha256").update(bytes).digest("hex");
const gemma = {
  ...tiny,
  "config.json": Buffer.from(
    JSON.stringify({ ...JSON.parse(tiny["config.json"]!.toString()), model_type: "gemma3" }),
  ),
};

let hub: HubStandin;
let server: RunningServer;
let admin: ArborClient;
beforeAll(async () => {
  hub = await startHubStandin({
    repos: [
      { id: "acme/tiny-chat", refs: { main: tiny } },
      { id: "acme/gated", refs: { main: tiny }, gated: true },
      { id: "acme/gemma", refs: { main: gemma } },
      {
        id: "acme/pickled",
        refs: { main: { "config.json": tiny["config.json"]!, "pytorch_model.bin": "pickle" } },
      },
    ],
  });
  server = await startServer({}, { env: { HF_ENDPOINT: hub.endpoint } });
  admin = server.authorizedClient({ timeout: 600_000 });
});
afterAll(async () => {
  await server?.close();
  await hub?.close();
});

/** The error body of a pull that is refused. */
async function refused(client: ArborClient, body: { repo_id: string; id?: string }) {
  const { response, error } = await client.POST("/v1/preview/base-models/pull", { body });
  return { status: response.status, error: (error as { error: Record<string, unknown> }).error };
}

describe("pullBaseModel", () => {
  it("when an operator pulls a repo, then it is answered pinned to its commit with each file's SHA-256, listed at once and chats", async () => {
    const pulled = await admin.training.baseModels.pull({
      repo_id: "acme/tiny-chat",
      revision: "main",
      id: "hub/tiny-chat",
    });
    expect(pulled).toMatchObject({
      id: "hub/tiny-chat",
      object: "base_model",
      repo_id: "acme/tiny-chat",
      revision: "main",
      commit: hub.commit("acme/tiny-chat"),
      endpoint: hub.endpoint,
      already_present: false,
    });
    expect(Object.fromEntries(pulled.files.map((f) => [f.path, f.sha256]))).toEqual(
      Object.fromEntries(Object.entries(tiny).map(([path, bytes]) => [path, sha256(bytes)])),
    );
    expect(pulled.bytes_fetched).toBe(Object.values(tiny).reduce((n, b) => n + b.length, 0));
    expect(existsSync(join(server.dataDir, "models", "hub", "tiny-chat", "arbor-pull.json"))).toBe(
      true,
    );

    const { data } = await admin.models.list();
    expect(data).toContainEqual(
      expect.objectContaining({ id: "hub/tiny-chat", owned_by: "system", parent: null }),
    );
    const completion = await admin.chat.completions.create({
      model: "hub/tiny-chat",
      messages: [{ role: "user", content: "What is 2 + 3?" }],
      max_tokens: 8,
      temperature: 0,
    });
    expect(completion.model).toBe("hub/tiny-chat");
    expect(completion.usage.completion_tokens).toBeGreaterThan(0);

    // The same pull again answers the folder as it is; the id is taken for another repo.
    const again = await admin.training.baseModels.pull({
      repo_id: "acme/tiny-chat",
      id: "hub/tiny-chat",
    });
    expect(again).toMatchObject({ already_present: true, bytes_fetched: 0 });
    expect(await refused(admin, { repo_id: "acme/gemma", id: "hub/tiny-chat" })).toMatchObject({
      status: 409,
      error: { type: "conflict_error", code: "base_model_exists", param: "id" },
    });
  });

  it("when a key that is not an operator's asks, then 403 and the Hub is not asked", async () => {
    const { client } = await server.newTenant("pull-tenant");
    const before = hub.requests.length;
    expect(await refused(client, { repo_id: "acme/tiny-chat", id: "t/tiny" })).toEqual({
      status: 403,
      error: {
        message: "Only an operator key may pull base models (arbor keys create --operator).",
        type: "permission_error",
        param: null,
        code: "permission_denied",
      },
    });
    expect(hub.requests.length).toBe(before);
  });

  it("when the model cannot be served, is gated, has only pickles or is not on the Hub, then 400 says why, with nothing left behind", async () => {
    expect(await refused(admin, { repo_id: "acme/gemma" })).toMatchObject({
      status: 400,
      error: {
        code: "unsupported_base_model",
        param: "repo_id",
        message: expect.stringMatching(/config\.json: model_type "gemma3" is not supported/),
      },
    });
    expect(
      hub.requests.some(
        (r) => r.url.startsWith("/acme/gemma/resolve/") && r.url.includes("safetensors"),
      ),
    ).toBe(false);
    expect(await refused(admin, { repo_id: "acme/pickled" })).toMatchObject({
      status: 400,
      error: { code: "unsupported_base_model", message: expect.stringMatching(/pickles/) },
    });
    expect(await refused(admin, { repo_id: "acme/gated" })).toMatchObject({
      status: 400,
      error: {
        type: "invalid_request_error",
        code: "hub_access_denied",
        message: expect.stringMatching(/acme\/gated is gated .*accept its terms .*HF_TOKEN/),
      },
    });
    expect(await refused(admin, { repo_id: "acme/nothing" })).toMatchObject({
      status: 400,
      error: { code: "hub_not_found", param: "repo_id" },
    });
    expect(await refused(admin, { repo_id: "not a repo" })).toMatchObject({ status: 400 });
    for (const id of ["acme/gemma", "acme/pickled", "acme/gated", "acme/nothing"])
      expect(existsSync(join(server.dataDir, "models", ...id.split("/")))).toBe(false);
    expect(existsSync(join(server.dataDir, "models", ".pulls"))).toBe(false);
    const { data } = await admin.models.list();
    expect(data.map((m) => m.id)).not.toContain("acme/gemma");
  });
});
