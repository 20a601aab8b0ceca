import { gzipSync } from "node:zlib";
import { adapterToFiles, catalogModelDir, createLoraAdapter, loadModel } from "@arbor/engine/model";
import { type HubStandin, startHubStandin } from "@arbor/engine/test/hub-standin";
import { loadSpec } from "@arbor/server";
import fc from "fast-check";
import tar from "tar-stream";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "../harness.ts";
import { pendingOperations } from "../pending.ts";
import { PG_URL, pgSkipReason } from "../pg.ts";
import { hostile, replaceNode, type Schema, SchemaArbitraries } from "./arbitraries.ts";

/**
 * Property-based fuzzing of every operation of the spec, on both stores: bodies, query strings,
 * path parameters and headers drawn from the spec's own schemas, then broken in known ways. No
 * answer may be a 5xx; every answer carries `x-request-id`; every error is in its surface's
 * envelope. `ARBOR_FUZZ_RUNS` sets the runs per operation (default 25).
 */
const RUNS = Number(process.env.ARBOR_FUZZ_RUNS ?? 25);

interface Operation {
  operationId: string;
  method: string;
  path: string;
  parameters: Schema[];
  requestBody: Schema | undefined;
}

const spec = loadSpec() as unknown as {
  paths: Record<string, Record<string, Schema>>;
  components: Record<string, Record<string, Schema>>;
};
const schemas = new SchemaArbitraries(spec);
// Deletes run last, so the fixtures they may remove serve every other operation first.
const operations: Operation[] = Object.entries(spec.paths)
  .flatMap(([path, item]) =>
    ["get", "post", "delete", "put", "patch"].flatMap((method) => {
      const op = item[method];
      if (!op) return [];
      return [
        {
          operationId: String(op.operationId),
          method: method.toUpperCase(),
          path,
          parameters: [
            ...((item.parameters ?? []) as unknown as Schema[]),
            ...((op.parameters ?? []) as Schema[]),
          ].map((p) => schemas.resolve(p)),
          requestBody: op.requestBody ? schemas.resolve(op.requestBody as Schema) : undefined,
        },
      ];
    }),
  )
  .sort((a, b) => Number(a.method === "DELETE") - Number(b.method === "DELETE"));

interface Fixtures {
  /** Real values for path parameters, so requests also reach past the lookup. */
  ids: Record<string, string[]> & { model_id: string[] };
  /** A model with no job, so that an upload to it reaches the adapter's checks (the target
   * model's queued job refuses uploads first). */
  uploadModelId: string;
}

interface FuzzRequest {
  method: string;
  path: string;
  headers: Record<string, string>;
  body: string | Uint8Array | undefined;
}

/** `arbitrary` one time in `1 + absent`, else nothing. */
function sometimes<T>(arbitrary: fc.Arbitrary<T>, absent = 4): fc.Arbitrary<T | null> {
  return fc.oneof({ weight: absent, arbitrary: fc.constant(null) }, { weight: 1, arbitrary });
}

const junkSegment = fc.oneof(
  fc.uuid(),
  fc.constantFrom("..", "%2e%2e", "%00", "a%2Fb", "%E2%80%AE", "x".repeat(2000), "1e308", "-1"),
  fc.string({ unit: "binary", minLength: 1, maxLength: 12 }).map(encodeURIComponent),
);

function requestOf(op: Operation, fixtures: Fixtures, key: string): fc.Arbitrary<FuzzRequest> {
  const pathParams = op.parameters.filter((p) => p.in === "path");
  const queryParams = op.parameters.filter((p) => p.in === "query");
  const path = fc
    .tuple(
      ...pathParams.map((p) =>
        fc.oneof(
          {
            weight: 3,
            arbitrary: fc
              .constantFrom(...(fixtures.ids[String(p.name)] ?? ["x"]))
              .map(encodeURIComponent),
          },
          { weight: 2, arbitrary: junkSegment },
        ),
      ),
    )
    .map((values) => {
      let i = 0;
      return op.path.replace(/\{[^}]+\}/g, () => values[i++] as string);
    });
  const query = fc
    .tuple(
      fc.tuple(
        ...queryParams.map((p) =>
          fc.oneof(
            { weight: 2, arbitrary: fc.constant(null) },
            {
              weight: 3,
              arbitrary: schemas.valid(p.schema as Schema).map((v) => [String(p.name), v] as const),
            },
            { weight: 1, arbitrary: hostile.map((v) => [String(p.name), v] as const) },
          ),
        ),
      ),
      sometimes(fc.tuple(fc.constantFrom("extra", "limit[]", "after[a]"), fc.string()), 8),
    )
    .map(([declared, extra]) => {
      const search = new URLSearchParams();
      for (const entry of [...declared, extra]) {
        if (!entry) continue;
        const [name, value] = entry;
        search.append(name, typeof value === "string" ? value : JSON.stringify(value));
      }
      const text = search.toString();
      return text ? `?${text}` : "";
    });
  const headers = fc.record({
    authorization: fc.oneof(
      { weight: 8, arbitrary: fc.constant(`Bearer ${key}`) },
      {
        weight: 1,
        arbitrary: fc.constantFrom(
          "",
          "Bearer",
          "Bearer sk-arb-nope",
          "Basic abc",
          `Bearer ${key} extra`,
        ),
      },
    ),
    project: fc.oneof(
      { weight: 6, arbitrary: fc.constant(null) },
      { weight: 3, arbitrary: fc.constant("default/fuzz") },
      {
        weight: 1,
        arbitrary: fc.constantFrom(
          "default/..",
          "other/p",
          "a/b/c",
          "default/x\u00e9",
          "x".repeat(300),
        ),
      },
    ),
    requestId: sometimes(fc.constantFrom("trace-1", "\u00e9\u00e9", "x".repeat(200))),
    accept: sometimes(fc.constantFrom("text/event-stream", "application/json", "image/png")),
  });
  const content = (op.requestBody?.content ?? {}) as Record<string, { schema?: Schema }>;
  const mediaTypes = Object.keys(content);
  const json = content["application/json"]?.schema;
  const bodyValue: fc.Arbitrary<unknown> = json
    ? fc.oneof(
        { weight: 2, arbitrary: schemas.minimal(json) },
        { weight: 3, arbitrary: schemas.valid(json) },
        {
          weight: 5,
          arbitrary: fc
            .tuple(schemas.valid(json), fc.nat(), hostile)
            .map(([value, at, replacement]) => replaceNode(value, at, replacement)),
        },
        { weight: 1, arbitrary: hostile },
      )
    : fc.oneof(
        fc.constant(
          `${JSON.stringify({
            messages: [
              { role: "user", content: "a" },
              { role: "assistant", content: "b" },
            ],
          })}\n`,
        ),
        fc.string({ unit: "binary", maxLength: 200 }),
        hostile.map((v) => JSON.stringify(v)),
      );
  const encoding = fc.oneof(
    {
      weight: 12,
      arbitrary: fc.constant<"plain" | "gzip" | "bad-gzip" | "zzz" | "truncated">("plain"),
    },
    {
      weight: 1,
      arbitrary: fc.constantFrom(
        "gzip" as const,
        "bad-gzip" as const,
        "zzz" as const,
        "truncated" as const,
      ),
    },
  );
  const mediaType = fc.oneof(
    { weight: 10, arbitrary: fc.constant(mediaTypes[0] ?? "application/json") },
    {
      weight: 1,
      arbitrary: fc.constantFrom(
        "application/json; charset=latin1",
        "application/json; charset=utf-16",
        "text/html",
        "application/x-www-form-urlencoded",
        "",
      ),
    },
  );
  return fc
    .tuple(path, query, headers, bodyValue, encoding, mediaType)
    .map(([p, q, h, value, how, type]) => {
      const out: Record<string, string> = {};
      if (h.authorization) out.authorization = h.authorization;
      if (h.project) out["compat-project"] = h.project;
      if (h.requestId) out["x-request-id"] = h.requestId;
      if (h.accept) out.accept = h.accept;
      let body: string | Uint8Array | undefined;
      if (op.requestBody) {
        const text = typeof value === "string" && !json ? value : (JSON.stringify(value) ?? "null");
        if (type) out["content-type"] = type;
        if (how === "gzip") {
          body = gzipSync(text);
          out["content-encoding"] = "gzip";
        } else if (how === "bad-gzip" || how === "zzz") {
          body = text;
          out["content-encoding"] = how === "zzz" ? "zzz" : "gzip";
        } else body = how === "truncated" ? text.slice(0, Math.floor(text.length / 2)) : text;
      }
      return { method: op.method, path: `${p}${q}`, headers: out, body };
    });
}

const calls = (path: string) => path.startsWith("/calls") || path.startsWith("/call/");

/** Sends one request and checks the answer; returns what is wrong with it, or null. An
 * operation still pending (pending.ts) may answer 501, as pending.test.ts proves it does. */
async function check(
  baseUrl: string,
  request: FuzzRequest,
  pending = false,
): Promise<string | null> {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), 120_000);
  try {
    const response = await fetch(`${baseUrl}${request.path}`, {
      method: request.method,
      headers: request.headers,
      ...(request.body !== undefined ? { body: request.body } : {}),
      signal: controller.signal,
    });
    const type = response.headers.get("content-type") ?? "";
    const problems: string[] = [];
    if (response.status >= 500 && !(pending && response.status === 501))
      problems.push(`status ${response.status}`);
    if (!response.headers.get("x-request-id")) problems.push("no x-request-id");
    if (type.startsWith("text/event-stream")) {
      // A live stream (followed events, a streamed chat): its headers are the answer.
      await response.body?.cancel();
      return problems.length ? `${problems.join(", ")}` : null;
    }
    const text = await response.text();
    if (response.status >= 400) {
      let body: unknown;
      try {
        body = JSON.parse(text);
      } catch {
        problems.push(`error body is not JSON: ${text.slice(0, 120)}`);
      }
      if (body !== undefined && !envelopeOk(body, calls(new URL(request.path, baseUrl).pathname)))
        problems.push(`not the surface's envelope: ${text.slice(0, 200)}`);
    }
    return problems.length ? `${problems.join(", ")} (${text.slice(0, 200)})` : null;
  } catch (err) {
    return `no answer: ${(err as Error).message}`;
  } finally {
    clearTimeout(timer);
  }
}

function envelopeOk(body: unknown, callsSurface: boolean): boolean {
  if (typeof body !== "object" || body === null) return false;
  const keys = Object.keys(body).sort().join(",");
  if (callsSurface) {
    if (keys !== "detail") return false;
    const detail = (body as { detail: unknown }).detail;
    return (
      typeof detail === "string" ||
      (Array.isArray(detail) &&
        detail.every(
          (d) => Array.isArray(d?.loc) && typeof d.msg === "string" && typeof d.type === "string",
        ))
    );
  }
  if (keys !== "error") return false;
  const error = (body as { error: Record<string, unknown> }).error;
  return (
    Object.keys(error).sort().join(",") === "code,message,param,type" &&
    typeof error.message === "string" &&
    typeof error.type === "string" &&
    (error.param === null || typeof error.param === "string") &&
    (error.code === null || typeof error.code === "string")
  );
}

/** A model, a job, a dataset and a call, so fuzzed ids also hit things that exist. */
async function fixturesOf(server: RunningServer): Promise<Fixtures> {
  const client = server.authorizedClient();
  const model = await client.training.models.create({
    project: "fuzz",
    name: "target",
    base_model: "arbor/tiny-chat",
  });
  const dataset = await client.training.datasets.create(
    `${JSON.stringify({
      messages: [
        { role: "user", content: "a" },
        { role: "assistant", content: "b" },
      ],
    })}\n`,
  );
  const job = await client.training.jobs.createSft({
    model_id: model.id,
    training_data_url: dataset.url,
  });
  const models = ["arbor/tiny-chat", "default/fuzz/target", "default/fuzz/target:step0"];
  schemas.hints = {
    model: models,
    model_id: [model.id],
    base_model: ["arbor/tiny-chat"],
    entity: ["default", null],
    project_id: ["default/fuzz"],
    training_data_url: [dataset.url],
    // Left out (undefined drops the key): fuzzed tools would have every chat generate a call;
    // tool-calling input is checked in tool-calling.test.ts and inference.test.ts.
    tools: [undefined],
    tool_choice: [undefined],
  };
  const uploads = await client.training.models.create({
    project: "fuzz",
    name: "uploads",
    base_model: "arbor/tiny-chat",
  });
  return {
    ids: { model_id: [model.id], training_job_id: [job.id], model: models },
    uploadModelId: uploads.id,
  };
}

async function tarOf(entries: { name: string; body: Uint8Array | string }[]): Promise<Buffer> {
  const pack = tar.pack();
  for (const { name, body } of entries) pack.entry({ name }, Buffer.from(body));
  pack.finalize();
  const chunks: Buffer[] = [];
  for await (const chunk of pack) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks);
}

/** Adapter uploads the checks must refuse with a 4xx: a header longer or with more tensors than
 * the base can need, a gzip bomb, weights that are not sound numbers, lora_alpha 1e308, a tensor
 * named twice. */
async function hostileAdapters(): Promise<{ body: Uint8Array; type: string }[]> {
  const base = await loadModel(catalogModelDir("arbor/tiny-chat"));
  const files = adapterToFiles(
    createLoraAdapter(base, { rank: 2, alpha: 4, baseModel: "arbor/tiny-chat" }, 1),
  );
  const config = files["adapter_config.json"]!;
  const withWeights = (weights: Uint8Array, adapterConfig: Uint8Array | string = config) =>
    tarOf([
      { name: "adapter_config.json", body: adapterConfig },
      { name: "adapter_model.safetensors", body: weights },
    ]);
  const safetensors = (header: string, data: Uint8Array = new Uint8Array(4)) => {
    const out = Buffer.alloc(8 + Buffer.byteLength(header) + data.length);
    out.writeBigUInt64LE(BigInt(Buffer.byteLength(header)), 0);
    out.write(header, 8);
    out.set(data, 8 + Buffer.byteLength(header));
    return out;
  };
  const weights = Buffer.from(files["adapter_model.safetensors"]!);
  const length = Number(weights.readBigUInt64LE(0));
  const header = weights
    .subarray(8, 8 + length)
    .toString()
    .trimEnd();
  const name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
  const entry = JSON.stringify(JSON.parse(header)[name]);
  const badWeight = (value: number) => {
    const adapter = createLoraAdapter(base, { rank: 2, alpha: 4 }, 1);
    adapter.layers[0]!.q!.b[0] = value;
    return adapterToFiles(adapter)["adapter_model.safetensors"]!;
  };
  const declared = Buffer.alloc(16);
  declared.writeBigUInt64LE(BigInt(100 * 1024 * 1024), 0);
  const bombHeader = tar.pack();
  const headerChunks: Buffer[] = [];
  bombHeader.on("data", (c: unknown) => headerChunks.push(c as Buffer));
  bombHeader.entry({ name: "README.md", size: 1 << 30 });
  await new Promise((resolve) => setImmediate(resolve));
  const zeros = gzipSync(Buffer.alloc(64 << 20), { level: 9 });
  const bomb = Buffer.concat([
    gzipSync(Buffer.concat(headerChunks).subarray(0, 512)),
    ...Array.from({ length: 16 }, () => zeros),
  ]);
  const tars = [
    await withWeights(declared),
    await withWeights(
      safetensors(
        `{${Array.from({ length: 57 }, (_, i) => `"t${i}":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}`).join(",")}}`,
      ),
    ),
    ...(await Promise.all(
      [Number.NaN, Number.POSITIVE_INFINITY, 1e30].map((v) => withWeights(badWeight(v))),
    )),
    await withWeights(
      weights,
      JSON.stringify({ ...JSON.parse(Buffer.from(config).toString()), lora_alpha: 1e308 }),
    ),
    await withWeights(
      safetensors(`${header.slice(0, -1)},"${name}":${entry}}`, weights.subarray(8 + length)),
    ),
  ];
  return [
    ...tars.map((body) => ({ body, type: "application/x-tar" })),
    { body: bomb, type: "application/gzip" },
  ];
}

/**
 * Requests that once answered 500, found by audits and earlier fuzzing: they stay as fixed seeds,
 * each a 4xx in the envelope on both stores.
 */
async function knownRequests(fixtures: Fixtures, key: string): Promise<FuzzRequest[]> {
  const auth = { authorization: `Bearer ${key}` };
  const model = fixtures.ids.model_id![0]!;
  return [
    // Adapters whose checks once cost seconds of the event loop, or let them through.
    ...(await hostileAdapters()).map(({ body, type }) => ({
      method: "POST",
      path: `/v1/preview/models/${fixtures.uploadModelId}/checkpoints`,
      headers: { ...auth, "content-type": type },
      body,
    })),
    // Malformed multipart on the checkpoint upload.
    {
      method: "POST",
      path: `/v1/preview/models/${model}/checkpoints`,
      headers: { ...auth, "content-type": "multipart/form-data; boundary=x" },
      body: "{}",
    },
    {
      method: "POST",
      path: `/v1/preview/models/${model}/checkpoints`,
      headers: { ...auth, "content-type": "multipart/form-data" },
      body: '--x\r\nContent-Disposition: form-data; name="a"\r\n\r\nb',
    },
    // Steps that are numbers but not plain integers.
    ...["1e3", "1.0", "0x10", "1e400", "+1", " 1"].map((step) => ({
      method: "GET",
      path: `/v1/preview/models/${model}/checkpoints/${encodeURIComponent(step)}/content`,
      headers: auth,
      body: undefined,
    })),
    // A percent-encoding that does not decode, in a model id with slashes and in a path.
    { method: "GET", path: "/v1/models/a/%E0%A4%A", headers: auth, body: undefined },
    { method: "GET", path: "/v1/models/%E0%A4%A", headers: auth, body: undefined },
    { method: "GET", path: `/v1/preview/models/%E0%A4%A`, headers: auth, body: undefined },
    // A metric name of 100,000 characters in a logged trajectory (names are 1–256 characters).
    {
      method: "POST",
      path: `/v1/preview/models/${model}/log`,
      headers: { ...auth, "content-type": "application/json" },
      body: JSON.stringify({
        split: "val",
        trajectory_groups: [
          {
            trajectories: [
              {
                messages_and_choices: [{ role: "user", content: "hi" }],
                reward: 1,
                metrics: { ["m".repeat(100_000)]: 1 },
              },
            ],
          },
        ],
      }),
    },
  ];
}

const backends: { name: string; postgres: boolean }[] = [
  { name: "sqlite", postgres: false },
  { name: "postgres", postgres: true },
];

for (const backend of backends) {
  describe.skipIf(backend.postgres && pgSkipReason !== null)(
    `every operation, fuzzed [${backend.name}]`,
    () => {
      let server: RunningServer;
      let hub: HubStandin;
      let fixtures: Fixtures;
      beforeAll(async () => {
        // pullBaseModel asks a Hub: an empty stand-in, where every repo is unknown (400).
        hub = await startHubStandin({ repos: [] });
        const env = { HF_ENDPOINT: hub.endpoint };
        server = await startServer(
          {},
          backend.postgres ? { postgres: { url: PG_URL }, env } : { env },
        );
        fixtures = await fixturesOf(server);
      });
      afterAll(async () => {
        await server.close();
        await hub.close();
      });

      it("when the requests that once answered 500 are sent again, then each is a 4xx in the envelope with a request id", async () => {
        for (const request of await knownRequests(fixtures, server.adminKey)) {
          const problem = await check(server.baseUrl, request);
          expect(problem, `${request.method} ${request.path}`).toBeNull();
        }
      });

      for (const op of operations) {
        it(`${op.operationId}: when fuzzed ${RUNS} times, then no answer is a 5xx and every error is in the envelope with a request id`, async () => {
          await fc.assert(
            fc.asyncProperty(requestOf(op, fixtures, server.adminKey), async (request) => {
              const problem = await check(
                server.baseUrl,
                request,
                (pendingOperations as readonly string[]).includes(op.operationId),
              );
              if (problem) {
                throw new Error(
                  `${request.method} ${request.path.slice(0, 200)} → ${problem}\nheaders: ${JSON.stringify(request.headers).slice(0, 300)}\nbody: ${String(request.body).slice(0, 300)}`,
                );
              }
            }),
            { numRuns: RUNS, endOnFailure: true },
          );
          expect(true).toBe(true);
        });
      }
    },
  );
}
