import { InvalidInputError } from "@arbor/store";
import { describe, expect, it } from "vitest";
import { type ChatRequest, type ChatTool, toGenerateRequest, toolRequestOf } from "./chat.ts";
import type { ChatEvent } from "./service.ts";
import { engineTools, readToolCalls, type ToolReading } from "./tool-calls.ts";

const add: ChatTool = {
  type: "function",
  function: {
    name: "add",
    parameters: {
      type: "object",
      properties: { a: { type: "integer" }, b: { type: "integer" } },
      required: ["a", "b"],
    },
  },
};
const now: ChatTool = { type: "function", function: { name: "now" } };

function request(extra: Partial<ChatRequest>): ChatRequest {
  return { model: "m", messages: [{ role: "user", content: "Hi" }], ...extra };
}

async function collect(events: AsyncIterable<ChatEvent>): Promise<ChatEvent[]> {
  const out: ChatEvent[] = [];
  for await (const event of events) out.push(event);
  return out;
}

/** The text in deltas of `pieces`, then its finish. */
async function* reply(pieces: string[]): AsyncGenerator<ChatEvent> {
  for (const content of pieces) yield { type: "delta", choice: 0, content, tokens: 1 };
  yield { type: "finish", choice: 0, content: "", finishReason: "stop" };
}

const hermes: ToolReading = { format: "hermes", prefill: "", parallel: true };

describe("tool requests", () => {
  it("when tool_choice names a function tools do not declare, or comes without tools, then 400 naming tool_choice", () => {
    const refusal = (extra: Partial<ChatRequest>) => {
      try {
        toolRequestOf(request(extra));
      } catch (err) {
        return err instanceof InvalidInputError ? err.param : err;
      }
      return undefined;
    };
    expect(
      refusal({ tools: [add], tool_choice: { type: "function", function: { name: "sub" } } }),
    ).toBe("tool_choice");
    expect(refusal({ tool_choice: "required" })).toBe("tool_choice");
    expect(refusal({ tools: [add, add] })).toBe("tools[1].function.name");
    expect(toolRequestOf(request({ tool_choice: "none" }))).toBeNull();
  });

  it("when a message other than an assistant's carries tool_calls, then 400 naming it", () => {
    const body = request({
      messages: [{ role: "user", content: "Hi", tool_calls: [] } as never],
    });
    expect(() => toGenerateRequest(body)).toThrow(
      "`messages[0].tool_calls` is supported on assistant messages only.",
    );
  });

  it("when a template has no tool calls, then tools are refused; a strict schema the engine cannot enforce is refused by its keyword", () => {
    expect(() => engineTools(null, toolRequestOf(request({ tools: [add] })), undefined)).toThrow(
      "`tools` is not supported by this model.",
    );
    const strict: ChatTool = {
      type: "function",
      function: { name: "f", strict: true, parameters: { type: "object", minProperties: 1 } },
    };
    expect(() =>
      engineTools("hermes", toolRequestOf(request({ tools: [strict] })), undefined),
    ).toThrow("tools[0].function.parameters.minProperties is not supported");
  });

  it("when a function is named, then the reply is prefilled with a call's opening and constrained to its arguments", () => {
    const plan = engineTools(
      "hermes",
      toolRequestOf(
        request({
          tools: [add, now],
          tool_choice: { type: "function", function: { name: "add" } },
        }),
      ),
      undefined,
    );
    expect(plan.prompt).toEqual({ tools: [add, now], prefill: "<tool_call>\n" });
    expect(plan.schema).toEqual({
      type: "object",
      properties: { name: { type: "string", enum: ["add"] }, arguments: add.function.parameters },
      required: ["name", "arguments"],
    });
    const auto = engineTools("hermes", toolRequestOf(request({ tools: [add] })), undefined);
    expect(auto.schema).toBeNull();
    expect(auto.toolCalls).toBeNull();
    const strict = engineTools(
      "hermes",
      toolRequestOf(request({ tools: [{ ...add, function: { ...add.function, strict: true } }] })),
      undefined,
    );
    expect(strict.toolCalls?.trigger).toBe("<tool_call>");
  });
  it("when a call to one of several functions is required, then the call is a choice by name, each with its own arguments' schema", () => {
    const plan = engineTools(
      "hermes",
      toolRequestOf(request({ tools: [add, now], tool_choice: "required" })),
      undefined,
    );
    const call = (name: string, parameters: unknown) => ({
      type: "object",
      properties: { name: { type: "string", enum: [name] }, arguments: parameters },
      required: ["name", "arguments"],
    });
    expect(plan.schema).toEqual({
      type: "object",
      discriminator: "name",
      oneOf: [call("add", add.function.parameters), call("now", { type: "object" })],
    });
    // A strict function whose own parameters are a choice keeps it inside the call's.
    const shape = {
      type: "object",
      properties: { kind: { enum: ["circle"] }, r: { type: "number" } },
      required: ["kind", "r"],
    };
    const draw: ChatTool = {
      type: "function",
      function: { name: "draw", strict: true, parameters: { oneOf: [shape] } },
    };
    const nested = engineTools(
      "hermes",
      toolRequestOf(request({ tools: [add, draw], tool_choice: "required" })),
      undefined,
    );
    expect(nested.schema).toMatchObject({
      oneOf: [{}, { properties: { arguments: { discriminator: "kind", oneOf: [shape] } } }],
    });
  });

  it("when a Llama template's functions are strict under auto, then a call is constrained from the `{` that starts the reply", () => {
    const strictAdd = { ...add, function: { ...add.function, strict: true } };
    const plan = engineTools(
      "llama3-json",
      toolRequestOf(request({ tools: [strictAdd, now] })),
      undefined,
    );
    expect(plan.schema).toBeNull();
    expect(plan.toolCalls).toMatchObject({
      trigger: "{",
      anchored: { first: ["", "<|python_tag|>"], next: [";"] },
      opensValue: true,
      schema: { type: "object", discriminator: "name" },
    });
    expect(plan.reading).toEqual({ format: "llama3-json", prefill: "", parallel: true });
  });
});

describe("reading tool calls", () => {
  it("when a reply has text then calls, then the text streams, the calls come as OpenAI streams them, and it ends with tool_calls", async () => {
    const events = await collect(
      readToolCalls(
        reply([
          "Sure",
          ".\n<tool",
          '_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
          '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        ]),
        hermes,
      ),
    );
    const text = events.flatMap((e) => (e.type === "delta" ? [e.content] : []));
    expect(text.join("")).toBe("Sure.\n");
    // Held-back tokens are still counted.
    expect(events.filter((e) => e.type === "delta")).toHaveLength(4);
    const calls = events.flatMap((e) => (e.type === "tool_call" ? [e] : []));
    const opening = (index: number, name: string) => ({
      index,
      id: expect.stringMatching(/^call_/),
      type: "function",
      function: { name, arguments: "" },
    });
    expect(calls).toEqual([
      { type: "tool_call", choice: 0, delta: opening(0, "add") },
      {
        type: "tool_call",
        choice: 0,
        delta: { index: 0, function: { arguments: '{"a":1,"b":2}' } },
      },
      { type: "tool_call", choice: 0, delta: opening(1, "now") },
      { type: "tool_call", choice: 0, delta: { index: 1, function: { arguments: "{}" } } },
    ]);
    expect(events.at(-1)).toEqual({
      type: "finish",
      choice: 0,
      content: "",
      finishReason: "tool_calls",
    });
    const single = await collect(
      readToolCalls(
        reply([
          '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "now", "arguments": {}}</tool_call>',
        ]),
        { ...hermes, parallel: false },
      ),
    );
    expect(single.filter((e) => e.type === "tool_call")).toHaveLength(2);
  });

  it("when a reply's call does not parse, then all of it is text and it ends as it did", async () => {
    const events = await collect(
      readToolCalls(reply(["Hmm <tool_call>{oops</tool_call>"]), hermes),
    );
    const text = events.map((e) => (e.type === "delta" || e.type === "finish" ? e.content : ""));
    expect(text.join("")).toBe("Hmm <tool_call>{oops</tool_call>");
    expect(events.at(-1)).toMatchObject({ type: "finish", finishReason: "stop" });
    const prefilled = await collect(
      readToolCalls(reply(["{oops"]), { ...hermes, prefill: "<tool_call>\n" }),
    );
    expect(prefilled.at(-1)).toMatchObject({ content: "<tool_call>\n{oops" });
  });

  it("when a Llama reply starts as JSON, then it is held and read as a call; other text streams", async () => {
    const llama: ToolReading = { format: "llama3-json", prefill: "", parallel: true };
    const call = await collect(
      readToolCalls(reply([" {", '"name": "now", "parameters": {}}']), llama),
    );
    expect(call.filter((e) => e.type === "delta" && e.content)).toHaveLength(0);
    expect(call.filter((e) => e.type === "tool_call")).toHaveLength(2);
    const text = await collect(readToolCalls(reply(["Paris", "."]), llama));
    expect(
      text.filter((e) => e.type === "delta").map((e) => e.type === "delta" && e.content),
    ).toEqual(["Paris", "."]);
  });
});
