import type { ArborClient } from "@arbor/client";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { PATIENT } from "../../../vitest.shared.ts";
import { type RunningServer, startServer } from "./harness.ts";
import { followAll, reversalJsonl } from "./jobs.ts";

/**
 * `GET /metrics` (Prometheus text, outside the spec's operations: ADR 34): scraped before
 * and after real traffic, its counters move by what the traffic did. Each chat goes through its
 * own tenant's key, since the server allows one chat per key and minute (for the 429).
 */
const MODEL = "arbor/tiny-chat";
let server: RunningServer;
beforeAll(async () => {
  server = await startServer({ rateLimits: { keyRequestsPerMinute: 1 } }, { worker: true });
});
afterAll(() => server.close());

interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}

/** The exposition format, strictly: every line a comment (`# HELP`, `# TYPE`) or a sample of a
 * declared metric; anything else throws. */
function parsePrometheus(text: string): Sample[] {
  const types = new Map<string, string>();
  const samples: Sample[] = [];
  for (const line of text.split("\n")) {
    if (line === "") continue;
    const type =
      /^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)$/.exec(line);
    if (type) {
      types.set(type[1]!, type[2]!);
      continue;
    }
    if (/^# HELP [a-zA-Z_:][a-zA-Z0-9_:]* .*$/.test(line)) continue;
    const sample = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$/.exec(line);
    if (!sample) throw new Error(`not a Prometheus text line: ${JSON.stringify(line)}`);
    const [, name, rawLabels = "", rawValue] = sample as unknown as [
      string,
      string,
      string,
      string,
    ];
    const labels: Record<string, string> = {};
    const rest = rawLabels.replace(
      /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)",?/g,
      (_, key: string, value: string) => {
        labels[key] = value.replace(/\\(.)/g, (_m, c: string) => (c === "n" ? "\n" : c));
        return "";
      },
    );
    if (rest !== "") throw new Error(`bad labels in ${JSON.stringify(line)}`);
    // Prometheus reads values as Go's ParseFloat does: NaN and Inf in any case (prom-client
    // writes `Nan`).
    const value = /^nan$/i.test(rawValue)
      ? Number.NaN
      : Number(rawValue.replace(/inf$/i, "Infinity"));
    if (Number.isNaN(value) && !/^nan$/i.test(rawValue)) throw new Error(`bad value in ${line}`);
    const family = name.replace(/_(bucket|sum|count)$/, "");
    if (!types.has(name) && !types.has(family))
      throw new Error(`sample of an undeclared metric: ${line}`);
    samples.push({ name, labels, value });
  }
  return samples;
}

/** The sum of the samples named `name` whose labels include `labels` (0 when there are none). */
function value(samples: Sample[], name: string, labels: Record<string, string> = {}): number {
  return samples
    .filter((s) => s.name === name && Object.entries(labels).every(([k, v]) => s.labels[k] === v))
    .reduce((sum, s) => sum + s.value, 0);
}

function has(samples: Sample[], name: string, labels: Record<string, string> = {}): boolean {
  return samples.some(
    (s) => s.name === name && Object.entries(labels).every(([k, v]) => s.labels[k] === v),
  );
}

async function scrape(target: RunningServer = server, key = target.adminKey): Promise<Sample[]> {
  const response = await fetch(`${target.baseUrl}/metrics`, {
    headers: { authorization: `Bearer ${key}` },
  });
  expect(response.status).toBe(200);
  expect(response.headers.get("content-type")).toBe("text/plain; version=0.0.4; charset=utf-8");
  return parsePrometheus(await response.text());
}

/** Scrapes until `check` passes: what a request or a job did is counted as it ends, which the
 * client may see a moment before the counter moves (a job's end comes from its thread). */
async function scrapeUntil(
  check: (samples: Sample[]) => void,
  target: RunningServer = server,
): Promise<Sample[]> {
  let last: Sample[] = [];
  await vi.waitFor(async () => {
    last = await scrape(target);
    check(last);
  }, PATIENT);
  return last;
}

const delta = (before: Sample[], after: Sample[], name: string, labels = {}) =>
  value(after, name, labels) - value(before, name, labels);

describe("GET /metrics", () => {
  it("when scraped with the first-start key (an operator's), then it is Prometheus text with Arbor's metrics and the process metrics", async () => {
    const samples = await scrape();
    for (const name of [
      "arbor_process_cpu_seconds_total",
      "arbor_nodejs_eventloop_lag_seconds",
      "arbor_training_tokens_total",
      "arbor_rate_limit_rejections_total",
    ]) {
      expect(has(samples, name), name).toBe(true);
    }
    // Read from the store at each scrape.
    expect(value(samples, "arbor_training_jobs", { status: "queued" })).toBe(0);
    expect(value(samples, "arbor_training_jobs", { status: "running" })).toBe(0);
    // Counters that exist before their first event read 0 (present, not merely absent).
    expect(has(samples, "arbor_training_jobs_total", { type: "sft", outcome: "succeeded" })).toBe(
      true,
    );
    expect(has(samples, "arbor_training_jobs", { status: "queued" })).toBe(true);
    expect(value(samples, "arbor_training_jobs_total", { type: "sft", outcome: "succeeded" })).toBe(
      0,
    );
  });

  it("when a chat completes, then its tokens, time to first token and request are counted by model and operation", async () => {
    const { client } = await server.newTenant("metrics-chat");
    const before = await scrape();
    const completion = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "What is 2 + 2?" }],
      max_tokens: 8,
      seed: 1,
    });
    const usage = completion.usage!;
    expect(usage.completion_tokens).toBeGreaterThan(0);
    const model = { model: MODEL };
    const ok = { operation: "createChatCompletion", status: "200" };
    const after = await scrapeUntil((s) =>
      expect(delta(before, s, "arbor_http_requests_total", ok)).toBe(1),
    );
    expect(delta(before, after, "arbor_chat_prompt_tokens_total", model)).toBe(usage.prompt_tokens);
    expect(delta(before, after, "arbor_chat_completion_tokens_total", model)).toBe(
      usage.completion_tokens,
    );
    expect(delta(before, after, "arbor_chat_time_to_first_token_seconds_count", model)).toBe(1);
    expect(delta(before, after, "arbor_http_request_duration_seconds_count", ok)).toBe(1);
    const engine = { backend: "engine" };
    expect(delta(before, after, "arbor_engine_generated_tokens_total", engine)).toBe(
      usage.completion_tokens,
    );
    expect(delta(before, after, "arbor_engine_generation_seconds_total", engine)).toBeGreaterThan(
      0,
    );
    // Labels are bounded: the operation, never the URL.
    expect(after.some((s) => Object.values(s.labels).some((v) => v.startsWith("/")))).toBe(false);
  });

  it("when a chat is streamed, then its time to first token and its usage are counted too", async () => {
    const { client } = await server.newTenant("metrics-stream");
    const before = await scrape();
    const stream = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "Name a colour." }],
      max_tokens: 6,
      seed: 2,
      stream: true,
      stream_options: { include_usage: true },
    });
    let usage: { prompt_tokens: number; completion_tokens: number } | undefined;
    for await (const chunk of stream) usage = chunk.usage ?? usage;
    expect(usage).toBeDefined();
    const model = { model: MODEL };
    const after = await scrapeUntil((s) =>
      expect(
        delta(before, s, "arbor_http_requests_total", {
          operation: "createChatCompletion",
          status: "200",
        }),
      ).toBe(1),
    );
    expect(delta(before, after, "arbor_chat_time_to_first_token_seconds_count", model)).toBe(1);
    expect(delta(before, after, "arbor_chat_completion_tokens_total", model)).toBe(
      usage!.completion_tokens,
    );
    expect(delta(before, after, "arbor_chat_prompt_tokens_total", model)).toBe(
      usage!.prompt_tokens,
    );
  });

  it("when a key passes its rate limit, then the rejection is counted by scope and as a 429 of the operation", async () => {
    const { client } = await server.newTenant("metrics-greedy");
    const before = await scrape();
    const ask = () =>
      client.POST("/v1/chat/completions", {
        body: { model: MODEL, messages: [{ role: "user", content: "Hi" }], max_tokens: 1 },
      });
    expect((await ask()).response.status).toBe(200);
    expect((await ask()).response.status).toBe(429);
    const after = await scrapeUntil((s) =>
      expect(
        delta(before, s, "arbor_http_requests_total", {
          operation: "createChatCompletion",
          status: "429",
        }),
      ).toBe(1),
    );
    expect(
      delta(before, after, "arbor_rate_limit_rejections_total", {
        scope: "key",
        limit: "requests_per_minute",
      }),
    ).toBe(1);
    expect(delta(before, after, "arbor_rate_limit_rejections_total")).toBe(1);
  });

  it("when an SFT job runs to its end, then the job, its duration and its tokens are counted by type and outcome", async () => {
    const client: ArborClient = server.authorizedClient();
    const before = await scrape();
    const { id: modelId } = await client.training.models.create({
      project: "metrics",
      name: "counted",
      base_model: MODEL,
    });
    const dataset = await client.training.datasets.create(
      reversalJsonl(["cat", "dog", "sun", "map"]),
    );
    const job = await client.training.jobs.createSft({
      model_id: modelId,
      training_data_url: dataset.url,
      config: { epochs: 1, batch_size: 2 },
    });
    const events = await followAll(client, job.id);
    expect(events.at(-1)!.type).toBe("training_ended");
    const tokens = events
      .filter((e) => e.type === "gradient_step")
      .reduce((sum, e) => sum + (e.data.num_tokens as number), 0);
    expect(tokens).toBeGreaterThan(0);

    const succeeded = { type: "sft", outcome: "succeeded" };
    const after = await scrapeUntil((s) =>
      expect(delta(before, s, "arbor_training_jobs_total", succeeded)).toBe(1),
    );
    expect(delta(before, after, "arbor_training_job_duration_seconds_count", succeeded)).toBe(1);
    expect(delta(before, after, "arbor_training_jobs_total", { outcome: "failed" })).toBe(0);
    expect(delta(before, after, "arbor_training_tokens_total", { type: "sft" })).toBe(tokens);
    expect(value(after, "arbor_training_jobs", { status: "queued" })).toBe(0);
    expect(value(after, "arbor_training_jobs", { status: "running" })).toBe(0);
    expect(
      delta(before, after, "arbor_http_requests_total", {
        operation: "createSftTrainingJob",
        status: "200",
      }),
    ).toBe(1);
  });
});

describe("GET /metrics: bounded labels", () => {
  it("when many trained models of several entities are chatted, then the model labels are the base model and one per entity, and no model's name appears", async () => {
    // A server of its own: no rate limit of one chat a minute per key.
    const busy = await startServer();
    try {
      const tenants = await Promise.all(
        ["acme-secret", "globex", "initech"].map((name) => busy.newTenant(name)),
      );
      for (const tenant of tenants) {
        for (let i = 0; i < 8; i++) {
          const name = `stealth-launch-${i}`;
          await tenant.client.training.models.create({
            project: "hidden",
            name,
            base_model: MODEL,
          });
          const chat = await tenant.client.POST("/v1/chat/completions", {
            body: {
              model: `${tenant.entity}/hidden/${name}`,
              messages: [{ role: "user", content: "Hi" }],
              max_tokens: 1,
            },
          });
          expect(chat.response.status).toBe(200);
        }
      }
      await busy.authorizedClient().chat.completions.create({
        model: MODEL,
        messages: [{ role: "user", content: "Hi" }],
        max_tokens: 1,
      });
      const response = await fetch(`${busy.baseUrl}/metrics`, {
        headers: { authorization: `Bearer ${busy.adminKey}` },
      });
      const text = await response.text();
      const samples = parsePrometheus(text);
      const models = new Set(samples.flatMap((s) => (s.labels.model ? [s.labels.model] : [])));
      expect([...models].sort()).toEqual([MODEL, "acme-secret/*", "globex/*", "initech/*"].sort());
      expect(text).not.toContain("stealth-launch");
      expect(text).not.toContain("hidden");
      // Each entity's eight models are one series.
      expect(
        value(samples, "arbor_chat_time_to_first_token_seconds_count", { model: "globex/*" }),
      ).toBe(8);
    } finally {
      await busy.close();
    }
  });
});

describe("ARBOR_METRICS", () => {
  const get = (target: RunningServer, headers: Record<string, string> = {}) =>
    fetch(`${target.baseUrl}/metrics`, { headers });

  it("when it is key (the default) and no key is sent, then 401 in the /v1 envelope", async () => {
    const response = await get(server);
    expect(response.status).toBe(401);
    expect(await response.json()).toEqual({
      error: {
        message: "Missing API key: send `Authorization: Bearer <API key>`.",
        type: "authentication_error",
        param: null,
        code: "invalid_api_key",
      },
    });
    const unknown = await get(server, { authorization: "Bearer sk-arb-unknownunknownunknown" });
    expect(unknown.status).toBe(401);
    expect(((await unknown.json()) as { error: { message: string } }).error.message).toBe(
      "Invalid API key.",
    );
  });

  it("when it is key and the key is not an operator's, then 403 permission_error, an admin of entity default's too", async () => {
    const tenant = await server.newTenant("metrics-reader");
    // A user first made in `default` is its admin, as `arbor keys create` makes one.
    const admin = await server.store.users.create({
      name: "default-admin",
      defaultEntity: "default",
    });
    expect(await server.store.users.roleIn(admin.id, "default")).toBe("admin");
    const { token } = await server.store.apiKeys.create(admin.id);
    for (const key of [tenant.apiKey, token]) {
      const response = await get(server, { authorization: `Bearer ${key}` });
      expect(response.status).toBe(403);
      expect(await response.json()).toEqual({
        error: {
          message: "Only an operator key may read the metrics (arbor keys create --operator).",
          type: "permission_error",
          param: null,
          code: "permission_denied",
        },
      });
    }
  });

  it("when it is key and the key is an operator's, then it scrapes, though its user is in no tenant's entity", async () => {
    const user = await server.store.users.create({ name: "prometheus", defaultEntity: "ops" });
    const { token } = await server.store.apiKeys.create(user.id, { operator: true });
    const response = await get(server, { authorization: `Bearer ${token}` });
    expect(response.status).toBe(200);
    expect(has(parsePrometheus(await response.text()), "arbor_training_jobs")).toBe(true);
  });

  it("when it is public, then anyone may scrape, on every role", async () => {
    const open = await startServer({ metrics: "public", roles: ["calls"] });
    try {
      const response = await get(open);
      expect(response.status).toBe(200);
      const samples = parsePrometheus(await response.text());
      expect(has(samples, "arbor_training_jobs", { status: "queued" })).toBe(true);
      // The calls role does not serve the model list: a 404, counted under no operation.
      expect((await open.authorizedClient().GET("/v1/models")).response.status).toBe(404);
      await scrapeUntil(
        (s) =>
          expect(
            value(s, "arbor_http_requests_total", { operation: "unknown", status: "404" }),
          ).toBe(1),
        open,
      );
    } finally {
      await open.close();
    }
  });

  it("when it is off, then /metrics is an unknown path, with or without a key", async () => {
    const closed = await startServer({ metrics: "off" });
    try {
      const withKey = { authorization: `Bearer ${closed.adminKey}` };
      for (const headers of [{}, withKey] as Record<string, string>[]) {
        const response = await get(closed, headers);
        expect(response.status).toBe(404);
        expect(((await response.json()) as { error: { type: string } }).error.type).toBe(
          "not_found_error",
        );
      }
    } finally {
      await closed.close();
    }
  });
});
