import { mkdtempSync, rmSync } from "node:fs";
import { readdir, readFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type ArborClient, type TrainingJobEvent, unwrap } from "@arbor/client";
import { LORA_TARGETS } from "@arbor/engine/model";
import { readAdapterTar } from "@arbor/training";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import {
  folderExists,
  startVllmStandin,
  type UpstreamCall,
  type VllmStandin,
} from "./vllm-standin.ts";

/**
 * Trained checkpoints of a base that an upstream serves are served by that upstream too, as
 * LoRA adapters it loads at run time (ADR 40). The upstream is a stand-in for vLLM's API
 * (`vllm-standin.ts`) that records every call and generates on a second, real Arbor server; it
 * sees the shared directory under another path (`/vllm/lora`), as a mount would.
 */
const BASE = "arbor/tiny-chat";
const PROJECT = "default/lora";
let backing: RunningServer;
let standin: VllmStandin;
let server: RunningServer;
let client: ArborClient;
let model: { id: string };
/** Step 3's files as its download gives them, kept for after the model is deleted. */
let step3Files: Record<string, Uint8Array>;
/** Each step's lora_name, as the stand-in saw it loaded. */
const names: Record<number, string> = {};
const shared = mkdtempSync(join(tmpdir(), "arbor-upstream-lora-"));

beforeAll(async () => {
  backing = await startServer();
  standin = await startVllmStandin({
    servedModel: "tiny-chat",
    backing,
    backingBase: BASE,
    mount: { at: "/vllm/lora", dir: shared },
  });
  server = await startServer(
    {
      upstreams: {
        [BASE]: { url: standin.url, model: "tiny-chat", loraDir: "/vllm/lora", maxLoras: 2 },
      },
      upstreamLoraDir: shared,
    },
    { worker: true },
  );
  client = server.authorizedClient({ project: PROJECT });
  // Trained here, on the engine (the base's folder is local); served there.
  model = await client.training.models.create({ project: "lora", name: "m", base_model: BASE });
  const lines = Array.from({ length: 8 }, (_, i) =>
    JSON.stringify({
      messages: [
        { role: "user", content: `What is the code word ${i}?` },
        { role: "assistant", content: "The code word is banana." },
      ],
    }),
  ).join("\n");
  const dataset = await client.training.datasets.create(lines);
  const job = await client.training.jobs.createSft({
    model_id: model.id,
    training_data_url: dataset.url,
    config: { batch_size: 4, epochs: 2, learning_rate: 1e-2, checkpoint_every: 1 },
    // The seven linears, as on any base over 100M parameters: vLLM loads LoRA on the output
    // head for some architectures only (its stand-in, none), and tiny-chat would adapt it.
    experimental_config: { lora_target_modules: [...LORA_TARGETS] },
  });
  const events: TrainingJobEvent[] = [];
  for await (const event of client.training.jobs.events.follow(job.id)) events.push(event);
  expect(events.at(-1)?.type).toBe("training_ended");
  expect(events.filter((e) => e.type === "gradient_step")).toHaveLength(4);
  step3Files = await downloaded(3);
});
afterAll(async () => {
  await server?.close();
  await standin?.close();
  await backing?.close();
  rmSync(shared, { recursive: true, force: true });
});

const QUESTION = [{ role: "user" as const, content: "What is the code word 3?" }];
const ask = (id: string, c: ArborClient = client) =>
  c.chat.completions.create({ model: id, messages: QUESTION, max_tokens: 8, temperature: 0 });
const step = (n: number) => `default/lora/m:step${n}`;

/** The calls the stand-in received from `from` on, as `<method> <path> <name>`. */
function callsSince(from: number): string[] {
  return standin.calls.slice(from).map(describeCall);
}
function describeCall(call: UpstreamCall): string {
  const name = call.body?.lora_name ?? call.body?.model ?? "";
  return `${call.method} ${call.path}${name ? ` ${String(name)}` : ""}${call.status === 404 ? " → 404" : ""}`;
}

/** The lora_name the stand-in saw loaded last. */
function lastLoaded(): string {
  const load = standin.calls.findLast((c) => c.path === "/v1/load_lora_adapter");
  return String(load?.body?.lora_name);
}

/** The checkpoint as its download gives it: PEFT's two files. */
async function downloaded(n: number): Promise<Record<string, Uint8Array>> {
  const response = await fetch(
    `${server.baseUrl}/v1/preview/models/${model.id}/checkpoints/${n}/content`,
    { headers: { authorization: `Bearer ${server.adminKey}` } },
  );
  expect(response.status).toBe(200);
  return readAdapterTar(Buffer.from(await response.arrayBuffer()));
}

/** Uploads PEFT files as a checkpoint of `modelId` on `target`; its status. */
async function upload(
  target: RunningServer,
  modelId: string,
  files: Record<string, Uint8Array>,
): Promise<number> {
  const form = new FormData();
  form.append("adapter_config", new Blob([files["adapter_config.json"]!]));
  form.append("adapter_model", new Blob([files["adapter_model.safetensors"]!]));
  const response = await fetch(`${target.baseUrl}/v1/preview/models/${modelId}/checkpoints`, {
    method: "POST",
    headers: { authorization: `Bearer ${target.adminKey}` },
    body: form,
  });
  await response.body?.cancel();
  return response.status;
}

const references = new Map<number, Promise<string>>();
/** What the engine answers for the checkpoint as its download gives it (uploaded to the
 * backing server, chatted with there directly). */
function referenceAnswer(n: number): Promise<string> {
  let answer = references.get(n);
  if (!answer) {
    answer = (async () => {
      const b = backing.authorizedClient();
      const reference = await b.training.models.create({
        project: "reference",
        name: `step${n}`,
        base_model: BASE,
      });
      expect(await upload(backing, reference.id, await downloaded(n))).toBe(200);
      const completion = await ask(`default/reference/step${n}`, b);
      return completion.choices[0]!.message.content ?? "";
    })();
    references.set(n, answer);
  }
  return answer;
}

describe("checkpoints on upstreams", () => {
  it("when a checkpoint's base is served by an upstream, then its adapter is registered there first, with a path the upstream reads, and the chat asks for it by name", async () => {
    const from = standin.calls.length;
    const completion = await ask(step(1));
    const name = lastLoaded();
    names[1] = name;
    expect(name).toMatch(/^arbor\.[0-9a-f-]+\.1-[0-9a-f-]+$/);
    expect(callsSince(from)).toEqual([
      `POST /v1/load_lora_adapter ${name}`,
      `POST /v1/chat/completions ${name}`,
    ]);
    const load = standin.calls[from]!;
    expect(load.body).toEqual({ lora_name: name, lora_path: `/vllm/lora/${name}` });
    // The folder holds exactly the checkpoint's PEFT files, as its download gives them.
    expect((await readdir(join(shared, name))).sort()).toEqual([
      "adapter_config.json",
      "adapter_model.safetensors",
    ]);
    const files = await downloaded(1);
    for (const file of ["adapter_config.json", "adapter_model.safetensors"]) {
      expect(Buffer.compare(await readFile(join(shared, name, file)), files[file]!)).toBe(0);
    }
    const config = JSON.parse(Buffer.from(files["adapter_config.json"]!).toString("utf8"));
    expect(config).toMatchObject({ peft_type: "LORA", base_model_name_or_path: BASE, r: 8 });
    // The answer is the engine's for that checkpoint, and it is ours: named and recorded.
    expect(completion.model).toBe(step(1));
    expect(completion.choices[0]!.message.content).toBe(await referenceAnswer(1));
    const { calls } = unwrap(
      await server.authorizedClient().POST("/calls/query", { body: { project_id: PROJECT } }),
    );
    expect(calls[0]!.summary.usage).toEqual({
      [step(1)]: {
        requests: 1,
        prompt_tokens: completion.usage.prompt_tokens,
        completion_tokens: completion.usage.completion_tokens,
        total_tokens: completion.usage.total_tokens,
      },
    });
    expect(completion.usage.completion_tokens).toBeGreaterThan(0);
  });

  it("when a loaded checkpoint is chatted with again, streamed, then it is not registered again and the chunks name our model", async () => {
    const from = standin.calls.length;
    const chunks = [];
    for await (const chunk of await client.chat.completions.create({
      model: step(1),
      messages: QUESTION,
      max_tokens: 8,
      temperature: 0,
      stream: true,
      stream_options: { include_usage: true },
    })) {
      expect(chunk.model).toBe(step(1));
      chunks.push(chunk);
    }
    expect(callsSince(from)).toEqual([`POST /v1/chat/completions ${lastLoaded()}`]);
    expect(chunks.map((c) => c.choices[0]?.delta.content ?? "").join("")).toBe(
      await referenceAnswer(1),
    );
    expect(chunks.at(-1)!.usage!.completion_tokens).toBeGreaterThan(0);
  });

  it("when the model's name is asked for, then its latest checkpoint is served there, and step 0 is the base itself", async () => {
    const from = standin.calls.length;
    const latest = await ask("default/lora/m");
    expect(latest.model).toBe(step(4));
    const fresh = await client.training.models.create({
      project: "lora",
      name: "untrained",
      base_model: BASE,
    });
    const base = await ask("default/lora/untrained");
    expect(base.model).toBe("default/lora/untrained:step0");
    expect(fresh.latest_step).toBe(0);
    const step4 = lastLoaded();
    names[4] = step4;
    // maxLoras 2: step 1 and 4 are loaded now.
    expect(callsSince(from)).toEqual([
      `POST /v1/load_lora_adapter ${step4}`,
      `POST /v1/chat/completions ${step4}`,
      "POST /v1/chat/completions tiny-chat",
    ]);
    expect([...standin.loaded.keys()]).toHaveLength(2);
  });

  it("when requests for a checkpoint not loaded arrive together, then it is registered once and every one is served", async () => {
    const from = standin.calls.length;
    const project = "default/lora-together";
    const together = server.authorizedClient({ project });
    const held = standin.holdLoads();
    const answers = Promise.all([1, 2, 3, 4].map(() => ask(step(2), together)));
    // Every request has been recorded as started (and so is waiting on the registration)
    // before the load is let through.
    await held.arrived;
    for (;;) {
      const { calls } = unwrap(
        await server.authorizedClient().POST("/calls/query", { body: { project_id: project } }),
      );
      if (calls.length === 4) break;
    }
    held.release();
    const completions = await answers;
    const name = lastLoaded();
    names[2] = name;
    const made = callsSince(from);
    expect(made.filter((c) => c.startsWith("POST /v1/load_lora_adapter"))).toEqual([
      `POST /v1/load_lora_adapter ${name}`,
    ]);
    expect(made.filter((c) => c === `POST /v1/chat/completions ${name}`)).toHaveLength(4);
    const answer = completions[0]!.choices[0]!.message.content;
    for (const c of completions) {
      expect(c.model).toBe(step(2));
      expect(c.choices[0]!.message.content).toBe(answer);
    }
  });

  it("when a third checkpoint is needed with two loaded, then the least recently used one is unloaded before it is loaded", async () => {
    // Loaded, least recently used first: step 4, then step 2 (step 1 went for step 2).
    expect([...standin.loaded.keys()]).toEqual([names[4], names[2]]);
    let from = standin.calls.length;
    await ask(step(3));
    names[3] = lastLoaded();
    expect(callsSince(from)).toEqual([
      `POST /v1/unload_lora_adapter ${names[4]}`,
      `POST /v1/load_lora_adapter ${names[3]}`,
      `POST /v1/chat/completions ${names[3]}`,
    ]);
    expect([...standin.loaded.keys()]).toEqual([names[2], names[3]]);
    // Using step 2 makes step 3 the least recently used.
    from = standin.calls.length;
    await ask(step(2));
    await ask(step(1));
    expect(callsSince(from)).toEqual([
      `POST /v1/chat/completions ${names[2]}`,
      `POST /v1/unload_lora_adapter ${names[3]}`,
      `POST /v1/load_lora_adapter ${names[1]}`,
      `POST /v1/chat/completions ${names[1]}`,
    ]);
  });

  it("when the upstream restarted and forgot the adapter, then it is registered again and the request succeeds", async () => {
    const name = names[1]!;
    expect([...standin.loaded.keys()]).toEqual([names[2], name]);
    standin.restart();
    const from = standin.calls.length;
    const completion = await ask(step(1));
    expect(completion.model).toBe(step(1));
    expect(completion.choices[0]!.message.content).toBe(await referenceAnswer(1));
    expect(callsSince(from)).toEqual([
      `POST /v1/chat/completions ${name} → 404`,
      `POST /v1/load_lora_adapter ${name}`,
      `POST /v1/chat/completions ${name}`,
    ]);
  });

  it("when a checkpoint is deleted, then the upstream unloads it and its folder goes; one it does not have is not unloaded", async () => {
    // Loaded there now: step 1 only (the restart forgot step 2, which this server still
    // counts as loaded).
    expect([...standin.loaded.keys()]).toEqual([names[1]]);
    expect(await folderExists(join(shared, names[1]!))).toBe(true);
    expect(await folderExists(join(shared, names[2]!))).toBe(true);
    const from = standin.calls.length;
    const result = await client.training.models.checkpoints.delete(model.id, [1, 2]);
    expect(result.deleted_count).toBe(2);
    expect(callsSince(from)).toEqual([
      "GET /v1/models",
      `POST /v1/unload_lora_adapter ${names[1]}`,
    ]);
    expect(standin.loaded.size).toBe(0);
    expect(await folderExists(join(shared, names[1]!))).toBe(false);
    expect(await folderExists(join(shared, names[2]!))).toBe(false);
    expect(await folderExists(join(shared, names[3]!))).toBe(true);
    const { response, error } = await client.POST("/v1/chat/completions", {
      body: { model: step(1), messages: QUESTION },
    });
    expect(response.status).toBe(404);
    expect(error).toMatchObject({ error: { code: "model_not_found", param: "model" } });
  });

  it("when the model is deleted, then every adapter of it loaded on the upstream is unloaded and no folder is left", async () => {
    await ask(step(3));
    await ask(step(4));
    const loaded = [...standin.loaded.keys()].sort();
    expect(loaded).toHaveLength(2);
    const from = standin.calls.length;
    await client.training.models.delete(model.id);
    const made = callsSince(from);
    expect(made[0]).toBe("GET /v1/models");
    expect(made.slice(1).sort()).toEqual(loaded.map((n) => `POST /v1/unload_lora_adapter ${n}`));
    expect(standin.loaded.size).toBe(0);
    expect((await readdir(shared)).filter((f) => f.includes(model.id))).toEqual([]);
  });

  it("when more checkpoints are asked for at once than the upstream may keep, then the last waits for a place and no more than maxLoras are ever loaded there", async () => {
    const many = await client.training.models.create({
      project: "lora",
      name: "many",
      base_model: BASE,
    });
    // Three checkpoints (the same weights under three names) of a fresh model.
    for (let i = 0; i < 3; i++) expect(await upload(server, many.id, step3Files)).toBe(200);
    const project = "default/lora-many";
    const c = server.authorizedClient({ project });
    standin.resetPeak();
    const from = standin.calls.length;
    const held = standin.holdLoads();
    const answers = Promise.all([1, 2, 3].map((n) => ask(`default/lora/many:step${n}`, c)));
    // Two loads are held there; the third request waits here for a place.
    await held.arrived;
    for (;;) {
      const { calls } = unwrap(
        await server.authorizedClient().POST("/calls/query", { body: { project_id: project } }),
      );
      if (calls.length === 3) break;
    }
    held.release();
    const completions = await answers;
    expect(completions.map((x) => x.model)).toEqual(
      [1, 2, 3].map((n) => `default/lora/many:step${n}`),
    );
    expect(new Set(completions.map((x) => x.choices[0]!.message.content))).toEqual(
      new Set([completions[0]!.choices[0]!.message.content]),
    );
    const made = callsSince(from);
    expect(made.filter((x) => x.startsWith("POST /v1/load_lora_adapter"))).toHaveLength(3);
    expect(made.filter((x) => x.startsWith("POST /v1/unload_lora_adapter"))).toHaveLength(1);
    expect(standin.peakLoaded()).toBe(2);
    await client.training.models.delete(many.id);
    expect(standin.loaded.size).toBe(0);
  });

  it("when the upstream cannot read the adapter's folder, then the chat is a 503 that says which path it was given and why", async () => {
    const misplaced = await startServer({
      upstreams: { [BASE]: { url: standin.url, model: "tiny-chat", loraDir: "/elsewhere" } },
    });
    try {
      const c = misplaced.authorizedClient();
      const target = await c.training.models.create({ project: "p", name: "n", base_model: BASE });
      expect(await upload(misplaced, target.id, step3Files)).toBe(200);
      const from = standin.calls.length;
      const { response, error } = await c.POST("/v1/chat/completions", {
        body: { model: "default/p/n", messages: QUESTION, max_tokens: 2 },
      });
      expect(response.status).toBe(503);
      expect(response.headers.get("x-should-retry")).toBe("true");
      const name = lastLoaded();
      expect(callsSince(from)).toEqual([`POST /v1/load_lora_adapter ${name} → 404`]);
      expect(error).toEqual({
        error: {
          message: expect.stringContaining(
            `did not load the checkpoint's adapter from /elsewhere/${name} (POST /v1/load_lora_adapter answered 404: Loading lora ${name} failed: No adapter found for /elsewhere/${name})`,
          ),
          type: "server_error",
          param: null,
          code: null,
        },
      });
    } finally {
      await misplaced.close();
    }
  });
});
