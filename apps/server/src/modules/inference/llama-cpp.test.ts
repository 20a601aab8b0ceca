import { mkdtemp, rm, stat } from "node:fs/promises";
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

/** Next-token logits (`vocab` of them) at every position of `tokens`, as llama.cpp computes
 * them from `path`. */
async function llamaLogits(path: string, tokens: number[], vocab: number): Promise<Float64Array[]> {
  const specifier = "node-llama-cpp";
  const { getLlama } = (await import(specifier)) as typeof import("node-llama-cpp");
  const llama = await getLlama({ gpu: false, build: "never", skipDownload: true });
  const model = await llama.loadModel({ modelPath: path, gpuLayers: 0 });
  try {
    const context = await model.createContext({ contextSize: 256, sequences: 1 });
    const results = await context
      .getSequence()
      .controlledEvaluate(
        tokens.map((token) => [token as never, { generateNext: { logits: true } }]),
      );
    return results.map((result) => {
      const row = new Float64Array(vocab);
      for (const [token, logit] of result!.next.logits!) row[token as number] = logit;
      return row;
    });
  } finally {
    await model.dispose();
  }
}

/** KL(P‖Q) of the softmaxes of two logit rows (llama-perplexity's `--kl-divergence`). */
function klDivergence(p: Float64Array, q: Float64Array): number {
  const logSoftmax = (row: Float64Array) => {
    const max = Math.max(...row);
    const log = Math.log(row.reduce((s, x) => s + Math.exp(x - max), 0)) + max;
    return row.map((x) => x - log);
  };
  const lp = logSoftmax(p);
  const lq = logSoftmax(q);
  return lp.reduce((s, l, i) => s + Math.exp(l) * (l - lq[i]!), 0);
}

const argmax = (row: Float64Array) => row.indexOf(Math.max(...row));

describe.skipIf(unavailable !== null)(
  "a Q8_0 GGUF export, in llama.cpp (node-llama-cpp, CPU)",
  () => {
    let dir: string;
    let model: Model;
    let f32: LlamaCppBackend;
    let q8: LlamaCppBackend;

    beforeAll(async () => {
      dir = await mkdtemp(join(tmpdir(), "arbor-llama-q8-"));
      model = await loadModel(catalogModelDir("arbor/tiny-chat"));
      await exportGguf(model, join(dir, "f32.gguf"), "arbor/tiny-chat");
      await exportGguf(model, join(dir, "q8_0.gguf"), "arbor/tiny-chat", "q8_0");
      f32 = new LlamaCppBackend(join(dir, "f32.gguf"));
      q8 = new LlamaCppBackend(join(dir, "q8_0.gguf"));
      await Promise.all([f32.load(), q8.load()]);
    });

    afterAll(async () => {
      await f32?.dispose();
      await q8?.dispose();
      if (dir) await rm(dir, { recursive: true, force: true });
    });

    it("is about a quarter of the F32 file", async () => {
      const f32Bytes = (await stat(join(dir, "f32.gguf"))).size;
      const q8Bytes = (await stat(join(dir, "q8_0.gguf"))).size;
      // The matrices take 34/128 of their F32 bytes; the vocabulary and norms are the rest.
      expect(q8Bytes / f32Bytes).toBeGreaterThan(34 / 128);
      expect(q8Bytes / f32Bytes).toBeLessThan(0.28);
    });

    it("continues prompts greedily as the F32 export does", async () => {
      const prompts: ChatMessage[][] = [
        messages,
        [{ role: "user", content: "Name three colours." }],
        [{ role: "user", content: "Tell me a short story about a cat." }],
      ];
      for (const chat of prompts) {
        const request = { messages: chat, temperature: 0, maxTokens: 16 };
        const ours = tokensOf(await collect(f32.generate(request)));
        const theirs = tokensOf(await collect(q8.generate(request)));
        expect(theirs.slice(0, 8), `prompt ${JSON.stringify(chat)}`).toEqual(ours.slice(0, 8));
      }
    });

    // Measured here 8.3e-4 mean (llama.cpp also rounds the activations to 8 bits for a Q8_0
    // matrix), 100 % same top; the bound leaves room for other CPUs' kernels.
    it("gives next-token distributions within a mean KL divergence of 2e-3 of the F32 export's, the same top token at 95 % of positions or more", async () => {
      const text = model.chat.encode(
        [
          { role: "system", content: "You are a helpful assistant." },
          { role: "user", content: "What is 12 + 30? Then tell me a short story about a cat." },
          { role: "assistant", content: "12 + 30 = 42. Once upon a time a cat sat on a mat." },
          { role: "user", content: "Name three colours and count from one to ten." },
        ],
        { addGenerationPrompt: true },
      );
      const vocab = model.config.vocabSize;
      const base = await llamaLogits(join(dir, "f32.gguf"), text, vocab);
      const quantized = await llamaLogits(join(dir, "q8_0.gguf"), text, vocab);
      expect(base[0]!.filter((x) => x !== 0).length).toBeGreaterThan(vocab / 2); // every logit read
      const kld = base.map((p, i) => klDivergence(p, quantized[i]!));
      const mean = kld.reduce((a, b) => a + b, 0) / kld.length;
      const sameTop =
        base.filter((p, i) => argmax(p) === argmax(quantized[i]!)).length / base.length;
      console.log(
        `llama.cpp Q8_0 vs F32, tiny-chat, ${text.length} positions: mean KLD ${mean.toExponential(3)}, max ${Math.max(...kld).toExponential(3)}, same top ${(sameTop * 100).toFixed(1)} %`,
      );
      expect(mean).toBeGreaterThan(0); // the weights did change
      expect(mean).toBeLessThan(2e-3);
      expect(sameTop).toBeGreaterThanOrEqual(0.95);
    });
  },
);

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
