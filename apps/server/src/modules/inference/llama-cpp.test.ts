import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  type ChatMessage,
  catalogModelDir,
  exportGguf,
  loadModel,
  type Model,
} from "@arbor/engine/model";
import { Engine, type GenerationEvent } from "@arbor/engine/serve";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { checkSupported, LlamaCppBackend, LlamaUnsupportedError } from "./llama-cpp.ts";

/** Skipped only when node-llama-cpp (an optional dependency) cannot be installed or loaded. */
const unavailable = await (async () => {
  try {
    const specifier = "node-llama-cpp";
    const { getLlama } = await import(specifier);
    await getLlama({ gpu: false, build: "never", skipDownload: true, dryRun: true });
    return null;
  } catch (err) {
    return err instanceof Error ? err.message : String(err);
  }
})();
if (unavailable) console.warn(`llama-cpp.test: skipping the llama.cpp tests: ${unavailable}`);

const messages: ChatMessage[] = [{ role: "user", content: "What is 7 + 5?" }];

async function collect(iter: AsyncIterable<GenerationEvent>): Promise<GenerationEvent[]> {
  const events: GenerationEvent[] = [];
  for await (const event of iter) events.push(event);
  return events;
}

function tokensOf(events: GenerationEvent[], choice = 0): number[] {
  return events.flatMap((e) => (e.type === "token" && e.choice === choice ? [e.token] : []));
}

function doneOf(events: GenerationEvent[], choice = 0) {
  const done = events.find((e) => e.type === "done" && e.choice === choice);
  if (done?.type !== "done") throw new Error(`no done event for choice ${choice}`);
  return done;
}

describe.skipIf(unavailable !== null)("LlamaCppBackend (node-llama-cpp, CPU)", () => {
  let dir: string;
  let model: Model;
  let engine: Engine;
  let backend: LlamaCppBackend;

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "arbor-llama-"));
    model = await loadModel(catalogModelDir("arbor/tiny-chat"));
    engine = new Engine(model);
    await exportGguf(model, join(dir, "tiny-chat.gguf"), "arbor/tiny-chat");
    backend = new LlamaCppBackend(join(dir, "tiny-chat.gguf"));
    await backend.load();
  });

  afterAll(async () => {
    await backend?.dispose();
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  it("has the model's context and renders ChatML to the engine's token count", async () => {
    expect(backend.contextLength).toBe(model.config.maxPositions);
    const ours = model.chat.encode(messages, { addGenerationPrompt: true });
    expect(await backend.countPromptTokens(messages)).toBe(ours.length);
  });

  it("generates text with the engine's event shapes", async () => {
    const events = await collect(
      backend.generate({ messages, temperature: 0.8, seed: 7, maxTokens: 24 }),
    );
    const done = doneOf(events);
    const streamed = events.map((e) => (e.type === "token" ? e.text : "")).join("") + done.delta;
    expect(done.text.length).toBeGreaterThan(0);
    expect(streamed).toBe(done.text);
    expect(done.promptTokens).toBe(await backend.countPromptTokens(messages));
    expect(done.tokens).toEqual(tokensOf(events));
    expect(["stop", "length"]).toContain(done.finishReason);
  });

  it("greedy output matches the built-in engine's for the same ChatML prompt", async () => {
    const prompts: ChatMessage[][] = [
      messages,
      [
        { role: "system", content: "You are a helpful assistant." },
        { role: "user", content: "Name three colours." },
      ],
      [{ role: "user", content: "Tell me a short story about a cat." }],
    ];
    for (const chat of prompts) {
      const request = { messages: chat, temperature: 0, maxTokens: 16 };
      const ours = await collect(engine.generate(request));
      const theirs = await collect(backend.generate(request));
      const a = tokensOf(ours);
      const b = tokensOf(theirs);
      // F32 weights on both sides: the argmax agrees unless two logits tie within rounding, so
      // the first tokens must match exactly (in practice the whole completion does).
      expect(b.slice(0, 5), `prompt ${JSON.stringify(chat)}`).toEqual(a.slice(0, 5));
      expect(doneOf(theirs).text.slice(0, 8)).toBe(doneOf(ours).text.slice(0, 8));
    }
  });

  it("honours maxTokens and n", async () => {
    const events = await collect(
      backend.generate({ messages, temperature: 1, seed: 3, maxTokens: 3, n: 2 }),
    );
    for (const choice of [0, 1]) {
      const done = doneOf(events, choice);
      expect(done.tokens.length).toBeLessThanOrEqual(3);
      if (done.finishReason === "length") expect(done.tokens.length).toBe(3);
    }
    const zero = await collect(backend.generate({ messages, maxTokens: 0 }));
    expect(zero).toHaveLength(1);
    expect(doneOf(zero).finishReason).toBe("length");
  });

  it("is reproducible for a seed", async () => {
    const request = { messages, temperature: 1, seed: 42, maxTokens: 12 };
    const a = tokensOf(await collect(backend.generate(request)));
    const b = tokensOf(await collect(backend.generate(request)));
    expect(b).toEqual(a);
  });

  it("stops at a stop string and leaves it out", async () => {
    const greedy = doneOf(
      await collect(backend.generate({ messages, temperature: 0, maxTokens: 16 })),
    ).text;
    const stop = greedy.slice(2, 4);
    expect(stop.length).toBe(2);
    const events = await collect(
      backend.generate({ messages, temperature: 0, maxTokens: 16, stop: [stop] }),
    );
    const done = doneOf(events);
    expect(done.finishReason).toBe("stop");
    expect(done.text).toBe(greedy.slice(0, greedy.indexOf(stop)));
    const streamed = events.map((e) => (e.type === "token" ? e.text : "")).join("") + done.delta;
    expect(streamed).toBe(done.text);
  });

  it("aborts with the signal's reason, and serves the next request", async () => {
    const controller = new AbortController();
    const seen: GenerationEvent[] = [];
    const run = async () => {
      for await (const event of backend.generate(
        // The abort lands as the first token arrives, before the greedy completion ends.
        { messages, temperature: 0, maxTokens: 200, stop: ["\u0000never"] },
        { signal: controller.signal },
      )) {
        seen.push(event);
        if (seen.length === 2) controller.abort(new Error("client went away"));
      }
    };
    await expect(run()).rejects.toThrow("client went away");
    expect(seen.filter((e) => e.type === "done")).toHaveLength(0);
    const already = AbortSignal.abort(new Error("before start"));
    await expect(collect(backend.generate({ messages }, { signal: already }))).rejects.toThrow(
      "before start",
    );
    const after = await collect(backend.generate({ messages, temperature: 0, maxTokens: 4 }));
    expect(doneOf(after).tokens.length).toBeGreaterThan(0);
  });

  it("refuses what it cannot honour, naming the field", async () => {
    await expect(collect(backend.generate({ messages, logprobs: true }))).rejects.toThrow(
      /logprobs/,
    );
    await expect(
      collect(backend.generate({ messages, responseFormat: { type: "json_object" } })),
    ).rejects.toThrow(/json_object/);
    await expect(collect(backend.generate({ messages, presencePenalty: 0.5 }))).rejects.toThrow(
      /presencePenalty/,
    );
  });
});

describe("checkSupported", () => {
  it("names the field it cannot honour", () => {
    expect(() => checkSupported({ messages, topLogprobs: 2 })).toThrow(LlamaUnsupportedError);
    try {
      checkSupported({ messages, responseFormat: { type: "json_schema", schema: {} } });
      expect.unreachable();
    } catch (err) {
      expect((err as LlamaUnsupportedError).field).toBe("responseFormat.json_schema");
    }
    expect(() =>
      checkSupported({ messages, temperature: 0.5, topP: 0.9, seed: 1, stop: ["x"], n: 2 }),
    ).not.toThrow();
  });
});
