import { Ajv } from "ajv";
import { describe, expect, it, vi } from "vitest";
import { PATIENT } from "../../../../vitest.shared.ts";
import { tinyConfig, tinyModel } from "../../test/fixtures.ts";
import { naiveLogits } from "../../test/naive-reference.ts";
import { jsKernels } from "../kernels/js.ts";
import { createWasmKernels } from "../kernels/wasm.ts";
import { Rng } from "../model/rng.ts";
import { callOpening, constrainedCall } from "../model/tool-calls.ts";
import { attentionSpan, chunkWithin, Engine, type GenerationEvent, stepCost } from "./engine.ts";
import { type JsonSchema, parseJsonSchema } from "./json-constraint.ts";

const model = tinyModel(21);
const prompt = model.tokenizer.encode("The cat sat", { special: true });

function argmax(values: number[]): number {
  let best = 0;
  for (let i = 1; i < values.length; i++) if (values[i]! > values[best]!) best = i;
  return best;
}

describe("Engine", () => {
  it("when prompt logprobs are asked, then each is the naive log-softmax of the logits before it, NaN at position 0", () => {
    const engine = new Engine(model, { kernels: jsKernels });
    const tokens = [...prompt, ...model.tokenizer.encode(" on the mat", { special: true })];
    const got = engine.promptLogprobs(tokens);
    expect(got).toHaveLength(tokens.length);
    expect(got[0]).toBeNaN();
    const logits = naiveLogits(model, tokens);
    for (let i = 1; i < tokens.length; i++) {
      const row = logits[i - 1]!;
      const max = Math.max(...row);
      const lse = max + Math.log(row.reduce((s, l) => s + Math.exp(l - max), 0));
      expect(got[i]).toBeCloseTo(row[tokens[i]!]! - lse, 4);
    }
  });

  it("when a stop token id is given and kept, then the sequence ends with it and its logprob; without keeping, it is dropped", async () => {
    const engine = new Engine(model, { kernels: jsKernels });
    const free = await engine.complete({ prompt, maxTokens: 6, temperature: 0, logprobs: true });
    const stopAt = free.choices[0]!.tokens[2]!;
    const stopAfter = free.choices[0]!.tokens.indexOf(stopAt);
    const kept = await engine.complete({
      prompt,
      maxTokens: 6,
      temperature: 0,
      logprobs: true,
      stopTokenIds: [stopAt],
      keepStopToken: true,
    });
    expect(kept.choices[0]!.finishReason).toBe("stop");
    expect(kept.choices[0]!.tokens).toEqual(free.choices[0]!.tokens.slice(0, stopAfter + 1));
    expect(kept.choices[0]!.logprobs).toHaveLength(stopAfter + 1);
    const dropped = await engine.complete({
      prompt,
      maxTokens: 6,
      temperature: 0,
      stopTokenIds: [stopAt],
    });
    expect(dropped.choices[0]!.tokens).toEqual(free.choices[0]!.tokens.slice(0, stopAfter));
  });

  it("when decoding greedily, then tokens equal a naive full-recompute argmax loop", async () => {
    const engine = new Engine(model, { kernels: jsKernels });
    const tokens = [...prompt];
    const expected: number[] = [];
    for (let i = 0; i < 8; i++) {
      const next = argmax(naiveLogits(model, tokens).at(-1)!);
      expected.push(next);
      tokens.push(next);
    }
    const result = await engine.complete({ prompt, maxTokens: 8, temperature: 0 });
    expect(result.choices[0]!.tokens).toEqual(expected);
    expect(result.choices[0]!.finishReason).toBe("length");
    expect(result.usage).toEqual({
      promptTokens: prompt.length,
      completionTokens: 8,
      totalTokens: prompt.length + 8,
    });
  });

  it("when sampling with a seed, then the first token follows the naive softmax under that seed", async () => {
    const engine = new Engine(model, { kernels: createWasmKernels() });
    const logits = naiveLogits(model, prompt).at(-1)!;
    const temperature = 0.7;
    for (const seed of [1, 2, 3, 4, 5]) {
      // Independent inverse-CDF sampling over the tokens in id order (no top-p cut).
      const max = Math.max(...logits);
      const weights = logits.map((l, token) => ({ token, w: Math.exp((l - max) / temperature) }));
      const total = weights.reduce((s, x) => s + x.w, 0);
      const rng = new Rng(
        ((): number => {
          // Mirrors deriveSeed(seed, 0): the documented per-choice stream.
          let z = ((seed ^ Math.imul(1, 0x9e3779b9)) >>> 0) + 0x9e3779b9;
          z |= 0;
          z = Math.imul(z ^ (z >>> 16), 0x85ebca6b);
          z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35);
          return (z ^ (z >>> 16)) >>> 0;
        })(),
      );
      let r = rng.next() * total;
      let expected = weights.at(-1)!.token;
      for (const { token, w } of weights) {
        r -= w;
        if (r <= 0) {
          expected = token;
          break;
        }
      }
      const result = await engine.complete({ prompt, maxTokens: 1, temperature, seed });
      expect(result.choices[0]!.tokens[0]).toBe(expected);
    }
  });

  it("when the same seed is reused, then the tokens repeat; another seed differs", async () => {
    const engine = new Engine(model);
    const run = (seed: number) => engine.complete({ prompt, maxTokens: 12, temperature: 1, seed });
    const a = await run(7);
    const b = await run(7);
    const c = await run(8);
    expect(b.choices[0]!.tokens).toEqual(a.choices[0]!.tokens);
    expect(c.choices[0]!.tokens).not.toEqual(a.choices[0]!.tokens);
  });

  it("when no seed is given, then each request and each of its choices samples afresh", async () => {
    const engine = new Engine(model);
    const unseeded = () => engine.complete({ prompt, maxTokens: 12, temperature: 1, n: 2 });
    const runs = await Promise.all([unseeded(), unseeded(), unseeded()]);
    const texts = runs.flatMap((r) => r.choices.map((c) => c.tokens.join(",")));
    // With one fixed seed every request repeated the first (its two choices aside): six samples
    // of 12 tokens at temperature 1 now give at least four different ones.
    expect(new Set(texts).size).toBeGreaterThanOrEqual(4);
  });

  it("when seeds differ only above bit 31, then their samples differ", async () => {
    const engine = new Engine(model);
    const run = (seed: number) => engine.complete({ prompt, maxTokens: 12, temperature: 1, seed });
    const low = await run(5);
    const high = await run(5 + 2 ** 32);
    expect(high.choices[0]!.tokens).not.toEqual(low.choices[0]!.tokens);
  });

  it("when requests run concurrently, then they share forward passes and match solo runs", async () => {
    const requests = [1, 2, 3, 4].map((seed) => ({
      prompt: model.tokenizer.encode(["Hello", "The dog", "Answer in", "7 + 5"][seed - 1]!, {
        special: true,
      }),
      maxTokens: 10,
      temperature: seed === 1 ? 0 : 0.9,
      seed,
    }));
    const solo = new Engine(model);
    const alone = [];
    for (const r of requests) alone.push((await solo.complete(r)).choices[0]!.tokens);
    expect(solo.stats.maxBatch).toBe(1);
    const shared = new Engine(model);
    const together = await Promise.all(requests.map((r) => shared.complete(r)));
    expect(together.map((c) => c.choices[0]!.tokens)).toEqual(alone);
    expect(shared.stats.maxBatch).toBe(4);
    expect(shared.stats.steps).toBeLessThan(solo.stats.steps / 2);
  });

  it("when prompts are prefilled in small chunks, then results equal one-shot prefill", async () => {
    const long = model.tokenizer.encode(
      "The cat sat on the mat. The dog sat on the log. Hello there!",
      { special: true },
    );
    const request = { prompt: long, maxTokens: 8, temperature: 0.8, seed: 4 };
    const oneShot = await new Engine(model).complete(request);
    const chunked = new Engine(model, { maxStepTokens: 5 });
    const [a, b] = await Promise.all([
      chunked.complete(request),
      chunked.complete({ ...request, seed: 5 }),
    ]);
    expect(a.choices[0]!.tokens).toEqual(oneShot.choices[0]!.tokens);
    expect(b.choices[0]!.tokens).toHaveLength(8);
    expect(chunked.stats.steps).toBeGreaterThan((2 * long.length) / 5);
  });

  it("when a short prompt arrives while a long one is being prefilled, then it is answered first, as it would be alone", async () => {
    const wide = tinyModel(21, { maxPositions: 16_384 });
    const long = Array.from({ length: 12_000 }, (_, i) => 3 + ((i * 7) % 250));
    const short = wide.tokenizer.encode("The cat sat on the mat.", { special: true });
    const alone = await new Engine(wide).complete({ prompt: short, maxTokens: 4, temperature: 0 });
    const engine = new Engine(wide);
    const order: string[] = [];
    const longDone = engine
      .complete({ prompt: long, maxTokens: 1, temperature: 0 })
      .then(() => order.push("long"));
    await vi.waitFor(() => expect(engine.stats.steps).toBeGreaterThan(0), PATIENT);
    const shortDone = engine
      .complete({ prompt: short, maxTokens: 4, temperature: 0 })
      .then((result) => {
        order.push("short");
        return result;
      });
    const [answer] = await Promise.all([shortDone, longDone]);
    expect(order).toEqual(["short", "long"]);
    expect(answer.choices[0]!.tokens).toEqual(alone.choices[0]!.tokens);
  });

  it("when a prompt is deep in the context, then a step takes fewer of its tokens: no step's work passes the budget by more than one token", () => {
    // tiny-chat's shapes: 2 heads of 64 (one KV head), hidden 128, MLP 352.
    const span = attentionSpan({
      ...tinyConfig(768),
      hiddenSize: 128,
      intermediateSize: 352,
      numHeads: 2,
      numKvHeads: 1,
      headDim: 64,
    });
    expect(span).toBe(720);
    let previous = Number.POSITIVE_INFINITY;
    for (const depth of [0, 100, 1000, 10_000, 100_000]) {
      const take = chunkWithin(512, depth, span, 1_000_000);
      expect(stepCost(take, depth, span)).toBeLessThanOrEqual(512);
      expect(stepCost(take + 1, depth, span)).toBeGreaterThan(512);
      expect(take).toBeLessThanOrEqual(previous);
      previous = take;
    }
    expect(chunkWithin(512, 0, span, 7)).toBe(7);
    expect(chunkWithin(0, 0, span, 7)).toBe(0);
    expect(chunkWithin(10, 1_000_000, span, 7)).toBe(0);
  });

  it("when a prompt's text cannot fit the context, then generate refuses it with the count it stopped at", () => {
    const engine = new Engine(model);
    const content = "The cat sat on the mat. ".repeat(20_000);
    expect(() => engine.generate({ messages: [{ role: "user", content }] })).toThrow(
      /^generate: prompt of at least \d+ tokens fills the 64-token context$/,
    );
    expect(() => engine.generate({ prompt: content })).toThrow(/at least \d+ tokens/);
  });

  it("when n > 1, then each choice is sampled independently", async () => {
    const engine = new Engine(model);
    const result = await engine.complete({ prompt, maxTokens: 6, temperature: 1, seed: 3, n: 3 });
    expect(result.choices.map((c) => c.index)).toEqual([0, 1, 2]);
    const distinct = new Set(result.choices.map((c) => c.tokens.join(",")));
    expect(distinct.size).toBeGreaterThan(1);
    expect(result.usage.completionTokens).toBe(18);
  });

  it("when a stop string appears, then the text ends before it and finish_reason is stop", async () => {
    const engine = new Engine(model);
    const free = await engine.complete({ prompt, maxTokens: 20, temperature: 0 });
    const text = free.choices[0]!.text;
    const stop = text.slice(4, 6);
    expect(stop.length).toBe(2);
    const streamed: string[] = [];
    let done: GenerationEvent | undefined;
    for await (const event of engine.generate({
      prompt,
      maxTokens: 20,
      temperature: 0,
      stop: [stop],
    })) {
      if (event.type === "token") streamed.push(event.text);
      else done = event;
    }
    expect(done?.type === "done" && done.finishReason).toBe("stop");
    const expected = text.slice(0, text.indexOf(stop));
    expect(done?.type === "done" && done.text).toBe(expected);
    expect(streamed.join("") + (done?.type === "done" ? done.delta : "")).toBe(expected);
  });

  it("when logprobs are asked for, then the chosen token's logprob and 20 sorted alternatives come back", async () => {
    const engine = new Engine(model);
    const result = await engine.complete({
      prompt,
      maxTokens: 3,
      temperature: 0,
      logprobs: true,
      topLogprobs: 20,
    });
    const logprobs = result.choices[0]!.logprobs!;
    expect(logprobs).toHaveLength(3);
    const first = logprobs[0]!;
    expect(first.topLogprobs).toHaveLength(20);
    expect(first.topLogprobs[0]!.token).toBe(first.token);
    expect(first.topLogprobs[0]!.logprob).toBeCloseTo(first.logprob, 6);
    const logits = naiveLogits(model, prompt).at(-1)!;
    const max = Math.max(...logits);
    const lse = max + Math.log(logits.reduce((s, l) => s + Math.exp(l - max), 0));
    expect(first.logprob).toBeCloseTo(logits[first.token]! - lse, 3);
    const values = first.topLogprobs.map((t) => t.logprob);
    expect(values).toEqual([...values].sort((a, b) => b - a));
  });

  it("when a frequency penalty is large, then greedy decoding stops repeating tokens", async () => {
    const engine = new Engine(model);
    const plain = await engine.complete({ prompt, maxTokens: 16, temperature: 0 });
    const penalised = await engine.complete({
      prompt,
      maxTokens: 16,
      temperature: 0,
      frequencyPenalty: 100,
    });
    const tokens = penalised.choices[0]!.tokens;
    expect(new Set(tokens).size).toBe(tokens.length);
    expect(new Set(plain.choices[0]!.tokens).size).toBeLessThan(16);
  });

  it("when aborted mid-stream, then the iterator rejects and the sequence leaves the batch", async () => {
    const engine = new Engine(model);
    const controller = new AbortController();
    const seen: number[] = [];
    const consume = async () => {
      for await (const event of engine.generate(
        { prompt, maxTokens: 40, temperature: 0 },
        { signal: controller.signal },
      )) {
        if (event.type === "token") seen.push(event.token);
        if (seen.length === 3) controller.abort(new Error("client went away"));
      }
    };
    await expect(consume()).rejects.toThrow("client went away");
    expect(seen.length).toBeLessThan(40);
    await new Promise((resolve) => setImmediate(resolve));
    expect(engine.activeSequences).toBe(0);
    expect(() => engine.generate({ prompt }, { signal: controller.signal })).toThrow(
      "client went away",
    );
  });

  it("when the consumer stops iterating early, then its sequences are dropped", async () => {
    const engine = new Engine(model);
    let count = 0;
    for await (const event of engine.generate({ prompt, maxTokens: 50, temperature: 0, n: 2 })) {
      if (event.type === "token") count++;
      if (count === 2) break;
    }
    await new Promise((resolve) => setImmediate(resolve));
    await new Promise((resolve) => setImmediate(resolve));
    expect(engine.activeSequences).toBe(0);
    expect(engine.stats.tokens).toBeLessThan(2 * prompt.length + 10);
  });

  it("when json_object is requested, then every sampled output parses as a JSON object", async () => {
    const engine = new Engine(model);
    for (let seed = 0; seed < 6; seed++) {
      const result = await engine.complete({
        prompt,
        maxTokens: 30,
        temperature: 1.2,
        seed,
        responseFormat: { type: "json_object" },
      });
      const parsed = JSON.parse(result.choices[0]!.text);
      expect(typeof parsed).toBe("object");
      expect(Array.isArray(parsed)).toBe(false);
    }
  });

  it("when a json_schema is requested, then outputs validate against it", async () => {
    const engine = new Engine(model);
    const schema: JsonSchema = {
      type: "object",
      properties: {
        name: { type: "string" },
        age: { type: "integer" },
        ok: { type: "boolean" },
        mood: { enum: ["happy", "sad"] },
        tags: { type: "array", items: { type: "number" } },
      },
      required: ["name", "age", "mood"],
    };
    for (let seed = 0; seed < 6; seed++) {
      const result = await engine.complete({
        prompt,
        maxTokens: 40,
        temperature: 1,
        seed,
        responseFormat: { type: "json_schema", schema },
      });
      const value = JSON.parse(result.choices[0]!.text) as Record<string, unknown>;
      expect(typeof value["name"]).toBe("string");
      expect(Number.isInteger(value["age"])).toBe(true);
      expect(["happy", "sad"]).toContain(value["mood"]);
      if ("ok" in value) expect(typeof value["ok"]).toBe("boolean");
      if ("tags" in value)
        expect((value["tags"] as unknown[]).every((t) => typeof t === "number")).toBe(true);
      for (const key of Object.keys(value))
        expect(["name", "age", "ok", "mood", "tags"]).toContain(key);
    }
  });

  it("when JSON output is closed early for want of tokens, then it parses and finishes as length", async () => {
    const engine = new Engine(model);
    const schema: JsonSchema = {
      type: "object",
      properties: { story: { type: "string" } },
      required: ["story"],
    };
    const reasons: string[] = [];
    for (let seed = 0; seed < 8; seed++) {
      const result = await engine.complete({
        prompt,
        maxTokens: 16,
        temperature: 2,
        seed,
        logprobs: true,
        responseFormat: { type: "json_schema", schema },
      });
      const choice = result.choices[0]!;
      expect(typeof (JSON.parse(choice.text) as { story: unknown }).story).toBe("string");
      // Every reported logprob is a number, forced closing tokens included.
      for (const lp of choice.logprobs ?? []) expect(Number.isFinite(lp.logprob)).toBe(true);
      // 16 tokens leave room for the shortest value, `{"story":""}` (12 here), but little more.
      if (choice.finishReason === "length") expect(choice.tokens).toHaveLength(16);
      reasons.push(choice.finishReason);
    }
    expect(reasons).toContain("length");
  });

  it("when tool calls are constrained, then each call after its opening is a valid value, and the model goes on after it", async () => {
    const engine = new Engine(model);
    const schema: JsonSchema = {
      type: "object",
      properties: { name: { enum: ["add"] }, arguments: { type: "object" } },
      required: ["name", "arguments"],
    };
    let goneOn = 0;
    for (let seed = 0; seed < 6; seed++) {
      const request = { prompt, maxTokens: 60, temperature: 1, seed };
      // The opening: a character the random model writes early at this seed, as a token of its
      // own; the reply is the same up to it.
      const free = (await engine.complete(request)).choices[0]!;
      const trigger = free.tokens
        .map((token) => model.tokenizer.decode([token]))
        .find((piece) => /^[!-~]$/.test(piece))!;
      const result = await engine.complete({ ...request, toolCalls: { trigger, schema } });
      const { text, finishReason } = result.choices[0]!;
      const opened = text.indexOf(trigger) + trigger.length;
      expect(text.slice(0, opened)).toBe(free.text.slice(0, opened));
      // After the opening, the longest prefix that parses is the call; what follows is free.
      const after = text.slice(opened);
      const end = [...after].map((_, i) => i + 1).findLast((i) => isJson(after.slice(0, i)));
      expect(end, text).toBeDefined();
      const call = JSON.parse(after.slice(0, end)) as Record<string, unknown>;
      expect(call["name"]).toBe("add");
      expect(typeof call["arguments"]).toBe("object");
      if (end! < after.length || finishReason === "stop") goneOn++;
    }
    expect(goneOn).toBeGreaterThan(0);
  });
});

/** Three functions whose arguments differ, each closed to its own properties. */
const TOOLS = [
  {
    name: "add",
    parameters: {
      type: "object",
      properties: { a: { type: "integer" }, b: { type: "integer" } },
      required: ["a", "b"],
      additionalProperties: false,
    },
  },
  {
    name: "say",
    parameters: {
      type: "object",
      properties: { text: { type: "string" }, loud: { type: "boolean" } },
      required: ["text"],
      additionalProperties: false,
    },
  },
  {
    name: "pick",
    parameters: {
      type: "object",
      properties: {
        choice: { enum: ["left", "right"] },
        weights: { type: "array", items: { type: "number" } },
      },
      required: ["choice", "weights"],
      additionalProperties: false,
    },
  },
];
const ajv = new Ajv({ strict: true });
const validators = new Map(TOOLS.map((tool) => [tool.name, ajv.compile(tool.parameters)]));

/** A call's JSON text checked by an independent validator against the schema of its tool. */
function expectValidCall(json: string, key: "arguments" | "parameters", context: string): string {
  const call = JSON.parse(json) as Record<string, unknown>;
  expect(Object.keys(call).sort(), context).toEqual([key, "name"].sort());
  const validate = validators.get(call["name"] as string);
  expect(validate, context).toBeDefined();
  expect(validate!(call[key]), `${context}: ${ajv.errorsText(validate!.errors)}`).toBe(true);
  return call["name"] as string;
}

describe("Engine tool calls", () => {
  const candidates = TOOLS.map(({ name, parameters }) => ({ name, parameters }));

  it("when a call to one of several functions is required, then every sampled call names one and its arguments validate against that function's schema", async () => {
    const engine = new Engine(model);
    const schema = parseJsonSchema(constrainedCall("hermes", candidates).schema);
    const named = new Set<string>();
    for (let seed = 0; seed < 40; seed++) {
      const result = await engine.complete({
        prompt,
        maxTokens: seed % 2 === 0 ? 48 : 200,
        temperature: 2,
        seed,
        responseFormat: { type: "json_schema", schema },
      });
      const { text } = result.choices[0]!;
      named.add(expectValidCall(text, "arguments", `seed ${seed}: ${text}`));
    }
    // High temperature on random weights reaches every function.
    expect([...named].sort()).toEqual(["add", "pick", "say"]);
  });

  it("when a Llama reply starts a call under auto, then the call is constrained to one function's schema, and a brace later in text is left alone", async () => {
    const engine = new Engine(model);
    const toolCalls = {
      ...callOpening("llama3-json"),
      schema: parseJsonSchema(constrainedCall("llama3-json", candidates).schema),
    };
    let calls = 0;
    let text = 0;
    for (let seed = 0; seed < 6000 && (calls < 8 || text < 3); seed++) {
      const request = { prompt, maxTokens: 1, temperature: 2, seed };
      const first = (await engine.complete(request)).choices[0]!.text;
      const startsCall = first.trimStart().startsWith("{");
      if (startsCall ? calls >= 8 : text >= 3) continue;
      const free = startsCall
        ? null
        : (await engine.complete({ ...request, maxTokens: 60 })).choices[0]!;
      if (!startsCall && !free!.text.slice(1).includes("{")) continue;
      const result = await engine.complete({ ...request, maxTokens: 60, toolCalls });
      const reply = result.choices[0]!.text;
      if (!startsCall) {
        // The reply did not start with a call: a `{` in its text opens none.
        expect(reply).toBe(free!.text);
        text++;
        continue;
      }
      // The reply is the call from its first character; the longest prefix that parses is it.
      const body = reply.trimStart();
      const end = [...body].map((_, i) => i + 1).findLast((i) => isJson(body.slice(0, i)));
      expect(end, reply).toBeDefined();
      expectValidCall(body.slice(0, end), "parameters", `seed ${seed}: ${reply}`);
      calls++;
    }
    expect(calls).toBe(8);
    expect(text).toBe(3);
  });
});

function isJson(text: string): boolean {
  try {
    JSON.parse(text);
    return true;
  } catch {
    return false;
  }
}
