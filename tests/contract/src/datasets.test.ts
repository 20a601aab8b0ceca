import type { ArborClient } from "@arbor/client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

let server: RunningServer;
let client: ArborClient;
beforeAll(async () => {
  server = await startServer();
  client = server.authorizedClient();
});
afterAll(() => server.close());

const line = (user: string, assistant: string) =>
  JSON.stringify({
    messages: [
      { role: "user", content: user },
      { role: "assistant", content: assistant },
    ],
  });
const good = `${line("Hi", "Hello! How can I help?")}\n${line("2 + 2?", "4")}\n`;

/** Sends raw JSONL through the client (openapi-fetch would JSON-encode the string). */
function upload(
  body: string,
  options: { contentType?: string; name?: string; as?: ArborClient } = {},
) {
  return (options.as ?? client).POST("/v1/preview/datasets", {
    params: { query: options.name === undefined ? {} : { name: options.name } },
    body,
    headers: { "content-type": options.contentType ?? "application/jsonl" },
    bodySerializer: (b: unknown) => b as string,
  });
}

const invalidDataset = (message: string) => ({
  error: { message, type: "invalid_request_error", param: null, code: "invalid_dataset" },
});

describe("createDataset", () => {
  it("when a valid JSONL file is uploaded, then the dataset is answered and its bytes stored as sent", async () => {
    const before = Math.floor(Date.now() / 1000);
    const { response, data, error } = await upload(good);
    expect(response.status, JSON.stringify(error)).toBe(200);
    const id = data!.id;
    expect(id).toMatch(/^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}$/);
    expect(data).toEqual({
      id,
      object: "dataset",
      url: `dataset://${id}`,
      name: null,
      bytes: Buffer.byteLength(good),
      lines: 2,
      created_at: expect.any(Number),
    });
    expect(data!.created_at).toBeGreaterThanOrEqual(before);
    expect(data!.created_at).toBeLessThanOrEqual(Math.ceil(Date.now() / 1000));
    const row = await server.store.datasets.get("default", id);
    expect(row).toMatchObject({ id, entity: "default", bytes: data!.bytes, lines: 2 });
    expect((await server.store.blobs.get(row!.blob_key))?.toString("utf8")).toBe(good);
  });

  it.each(["application/jsonl", "application/x-ndjson", "text/plain"])(
    "when the content type is %s, then the upload is accepted",
    async (contentType) => {
      const { response, data, error } = await upload(good, { contentType });
      expect(response.status, JSON.stringify(error)).toBe(200);
      expect(data).toMatchObject({ object: "dataset", lines: 2, bytes: Buffer.byteLength(good) });
    },
  );

  it("when ?name= is given, then it is shown back as name", async () => {
    const { response, data } = await upload(good, { name: "support-sft-v1" });
    expect(response.status).toBe(200);
    expect(data!.name).toBe("support-sft-v1");
    expect((await server.store.datasets.get("default", data!.id))?.name).toBe("support-sft-v1");
  });

  it("when lines are blank, end in CRLF or carry tools and text parts, then only non-empty lines count", async () => {
    const withTools = JSON.stringify({
      messages: [
        { role: "system", content: "Be brief." },
        { role: "user", content: [{ type: "text", text: "Weather?" }] },
        {
          role: "assistant",
          content: null,
          tool_calls: [
            { id: "c1", type: "function", function: { name: "weather", arguments: "{}" } },
          ],
        },
        { role: "tool", tool_call_id: "c1", content: "sunny" },
        { role: "assistant", content: [{ type: "text", text: "Sunny." }] },
      ],
      tools: [{ type: "function", function: { name: "weather", parameters: {} } }],
    });
    const body = `\r\n${line("a", "b")}\r\n\r\n   \n${withTools}\n\n`;
    const { response, data, error } = await upload(body);
    expect(response.status, JSON.stringify(error)).toBe(200);
    expect(data).toMatchObject({ lines: 2, bytes: Buffer.byteLength(body) });
  });

  it("when a line is not valid JSON, then 400 invalid_dataset naming that line", async () => {
    const { response, error } = await upload(`${line("a", "b")}\n\n{"messages": [\n`);
    expect(response.status).toBe(400);
    expect(error).toEqual(invalidDataset("Line 3: not valid JSON."));
  });

  it("when a line has no assistant turn, then 400 naming the line", async () => {
    const body = `${line("a", "b")}\n${JSON.stringify({ messages: [{ role: "user", content: "hi" }] })}\n`;
    const { response, error } = await upload(body);
    expect(response.status).toBe(400);
    expect(error).toEqual(
      invalidDataset("Line 2: messages has no assistant message to learn from."),
    );
  });

  it("when a message has an unknown role, then 400 naming the line and the message", async () => {
    const body = JSON.stringify({
      messages: [
        { role: "user", content: "a" },
        { role: "robot", content: "b" },
      ],
    });
    const { response, error } = await upload(body);
    expect(response.status).toBe(400);
    expect(error).toEqual(
      invalidDataset(
        "Line 1: messages[1].role must be one of system, developer, user, assistant, tool.",
      ),
    );
  });

  it("when a line has no messages, then 400 naming the line", async () => {
    const { response, error } = await upload(`${line("a", "b")}\n{"messages": []}`);
    expect(response.status).toBe(400);
    expect(error).toEqual(invalidDataset("Line 2: messages must be a non-empty array."));
  });

  it.each([
    ["empty", ""],
    ["only blank lines", "\n  \r\n\n"],
  ])("when the body is %s, then 400 invalid_dataset", async (_, body) => {
    const { response, error } = await upload(body);
    expect(response.status).toBe(400);
    expect(error).toEqual(invalidDataset(expect.stringContaining("empty") as never));
  });

  it("when an upload is rejected, then nothing is stored", async () => {
    const tenant = await server.newTenant("rejected-uploads");
    const blobsBefore = await server.store.blobs.list("datasets/");
    const bad = `${line("a", "b")}\nnot json\n`;
    expect((await upload(bad, { as: tenant.client })).response.status).toBe(400);
    expect((await upload("", { as: tenant.client })).response.status).toBe(400);
    expect((await server.store.datasets.list(tenant.entity)).data).toEqual([]);
    expect(await server.store.blobs.list("datasets/")).toEqual(blobsBefore);
  });

  it("when the project header names another entity of the key, then the dataset belongs to it", async () => {
    const tenant = await server.newTenant("uploader");
    await server.store.entities.ensure("uploader-team");
    const user = (await server.store.users.getByName("uploader"))!;
    await server.store.users.addMembership(user.id, "uploader-team");
    const teamClient = server.client({
      apiKey: tenant.apiKey,
      headers: { "Compat-Project": "uploader-team/sft" },
    });
    const { response, data } = await upload(good, { as: teamClient });
    expect(response.status).toBe(200);
    expect(await server.store.datasets.get("uploader-team", data!.id)).toMatchObject({
      entity: "uploader-team",
    });
    expect(await server.store.datasets.get("uploader", data!.id)).toBeUndefined();
  });

  it("when the project header names an entity the key may not use, then 403 and nothing is stored", async () => {
    const tenant = await server.newTenant("outsider-uploads");
    const foreign = server.client({
      apiKey: tenant.apiKey,
      headers: { "Compat-Project": "default/sft" },
    });
    const before = (await server.store.datasets.list("default", { limit: 100 })).data.length;
    const { response, error } = await upload(good, { as: foreign });
    expect(response.status).toBe(403);
    expect(error).toEqual({
      error: {
        message: 'This API key may not act for entity "default".',
        type: "permission_error",
        param: null,
        code: "permission_denied",
      },
    });
    expect((await server.store.datasets.list("default", { limit: 100 })).data.length).toBe(before);
  });

  it("when the body is over 64 MB, then 413 request_too_large and nothing is stored", async () => {
    const tenant = await server.newTenant("big-uploads");
    const oneLine = `${line("x".repeat(1000), "y")}\n`;
    const body = oneLine.repeat(Math.ceil((64 * 1024 * 1024 + 1) / oneLine.length));
    const { response, error } = await upload(body, { as: tenant.client });
    expect(response.status).toBe(413);
    expect(error).toEqual({
      error: {
        message: expect.any(String),
        type: "invalid_request_error",
        param: null,
        code: "request_too_large",
      },
    });
    expect((await server.store.datasets.list(tenant.entity)).data).toEqual([]);
  });
});

describe("listDatasets", () => {
  const list = (query: { after?: string; limit?: number; name?: string } = {}, as = client) =>
    as.GET("/v1/preview/datasets", { params: { query } });

  it("when a tenant uploaded three datasets, then they are listed newest first, a page at a time, and no one else's", async () => {
    const tenant = await server.newTenant("lister");
    const other = await server.newTenant("other-lister");
    const ids: string[] = [];
    for (const name of ["first", "second", "third"]) {
      const { data } = await upload(good, { name, as: tenant.client });
      ids.push(data!.id);
    }
    await upload(good, { name: "first", as: other.client });

    const page1 = await list({ limit: 2 }, tenant.client);
    expect(page1.response.status).toBe(200);
    expect(page1.data).toEqual({
      object: "list",
      data: [
        {
          id: ids[2],
          object: "dataset",
          url: `dataset://${ids[2]}`,
          name: "third",
          bytes: Buffer.byteLength(good),
          lines: 2,
          created_at: expect.any(Number),
        },
        expect.objectContaining({ id: ids[1], name: "second" }),
      ],
      first_id: ids[2],
      last_id: ids[1],
      has_more: true,
    });
    const page2 = await list({ limit: 2, after: page1.data!.last_id! }, tenant.client);
    expect(page2.data).toEqual({
      object: "list",
      data: [expect.objectContaining({ id: ids[0], name: "first" })],
      first_id: ids[0],
      last_id: ids[0],
      has_more: false,
    });
  });

  it("when a name is given, then only the datasets uploaded under it", async () => {
    const tenant = await server.newTenant("name-lister");
    const a = (await upload(good, { name: "answers", as: tenant.client })).data!;
    await upload(good, { name: "questions", as: tenant.client });
    const b = (await upload(good, { name: "answers", as: tenant.client })).data!;
    const { data } = await list({ name: "answers" }, tenant.client);
    expect(data!.data.map((d) => d.id)).toEqual([b.id, a.id]);
    expect((await list({ name: "nothing-here" }, tenant.client)).data).toEqual({
      object: "list",
      data: [],
      first_id: null,
      last_id: null,
      has_more: false,
    });
  });

  it("when a tenant has uploaded nothing, then the list is empty", async () => {
    const tenant = await server.newTenant("empty-lister");
    expect((await list({}, tenant.client)).data).toEqual({
      object: "list",
      data: [],
      first_id: null,
      last_id: null,
      has_more: false,
    });
  });

  it("when limit is out of range, then 400 with the contract's envelope", async () => {
    const { response, error } = await list({ limit: 0 });
    expect(response.status).toBe(400);
    expect(error).toEqual({
      error: {
        message: expect.stringMatching(/^limit: /),
        type: "invalid_request_error",
        param: "limit",
        code: null,
      },
    });
  });

  it("when the client lists, then it pages through every dataset", async () => {
    const tenant = await server.newTenant("client-lister");
    const uploaded: string[] = [];
    for (let i = 0; i < 3; i++)
      uploaded.push((await tenant.client.training.datasets.create(good, { name: `set${i}` })).id);
    const seen: string[] = [];
    for await (const d of tenant.client.training.datasets.list({ limit: 1 })) seen.push(d.id);
    expect(seen).toEqual([...uploaded].reverse());
  });
});

describe("listDatasetLines", () => {
  const lines = (id: string, query: { after?: string; limit?: number } = {}, as = client) =>
    as.GET("/v1/preview/datasets/{dataset_id}/lines", {
      params: { path: { dataset_id: id }, query },
    });

  it("when a dataset is paged through, then every example comes once, as uploaded, with its line number", async () => {
    const third = {
      messages: [
        { role: "user", content: [{ type: "text", text: "Weather?" }] },
        {
          role: "assistant",
          content: null,
          tool_calls: [{ function: { name: "w", arguments: "{}" } }],
        },
        { role: "tool", content: "sunny", tool_call_id: "c1" },
        { role: "assistant", content: "Sunny." },
      ],
      tools: [{ type: "function", function: { name: "w" } }],
    };
    const text = `${line("a", "b")}\r\n\n${line("c", "d")}\n${JSON.stringify(third)}\n`;
    const { data: dataset } = await upload(text);
    const first = await lines(dataset!.id, { limit: 2 });
    expect(first.response.status).toBe(200);
    expect(first.data).toEqual({
      object: "list",
      data: [
        { id: "1", object: "dataset.line", line: 1, example: JSON.parse(line("a", "b")) },
        { id: "3", object: "dataset.line", line: 3, example: JSON.parse(line("c", "d")) },
      ],
      first_id: "1",
      last_id: "3",
      has_more: true,
    });
    const second = await lines(dataset!.id, { after: "3", limit: 2 });
    expect(second.data).toEqual({
      object: "list",
      data: [{ id: "4", object: "dataset.line", line: 4, example: third }],
      first_id: "4",
      last_id: "4",
      has_more: false,
    });
    const past = await lines(dataset!.id, { after: "4" });
    expect(past.data).toEqual({
      object: "list",
      data: [],
      first_id: null,
      last_id: null,
      has_more: false,
    });
  });

  it("when the dataset is another entity's or unknown, then 404 dataset_not_found", async () => {
    const { data: dataset } = await upload(good);
    const tenant = await server.newTenant("line-reader");
    for (const [id, as] of [
      [dataset!.id, tenant.client],
      ["0193a0b3-f0e1-7d2c-ab3c-4d5e6f708192", client],
    ] as const) {
      const { response, error } = await lines(id, {}, as);
      expect(response.status).toBe(404);
      expect(error).toEqual({
        error: {
          message: `Dataset "${id}" not found.`,
          type: "not_found_error",
          param: null,
          code: "dataset_not_found",
        },
      });
    }
  });

  it("when after is not a line number, then 400 invalid_cursor", async () => {
    const { data: dataset } = await upload(good);
    const { response, error } = await lines(dataset!.id, { after: "x" });
    expect(response.status).toBe(400);
    expect(error).toMatchObject({ error: { param: "after", code: "invalid_cursor" } });
  });
});
