import { describe, expect, it } from "vitest";
import { JsonConstraint, type JsonSchema } from "./json-constraint.ts";

const accepts = (text: string, schema?: JsonSchema) => new JsonConstraint(schema).feed(text);

describe("JsonConstraint", () => {
  it("when fed valid JSON prefixes, then it accepts them and knows when the value is complete", () => {
    for (const text of [
      '{"a": [1, -2.5e3, true, null, "x\\n\\u00e9"], "b": {}}',
      "{}",
      '{"k":0}',
    ]) {
      const state = new JsonConstraint();
      for (const ch of text) expect(state.feed(ch), text).toBe(true);
      expect(state.complete).toBe(true);
    }
    expect(new JsonConstraint().feed('{"a":')).toBe(true);
  });

  it("when fed invalid JSON, then it rejects at the first bad character", () => {
    for (const text of [
      "[1]",
      '{"a" 1}',
      '{"a":01}',
      '{"a":tru}',
      '{"a":1,}',
      '{"a":"\u0001"}',
      "{}}",
      '{"a":-}',
    ]) {
      expect(accepts(text), text).toBe(false);
    }
  });

  it("when a schema is given, then keys, types, enums and required keys are enforced", () => {
    const schema: JsonSchema = {
      type: "object",
      properties: {
        n: { type: "integer" },
        s: { enum: ["yes", "no"] },
        l: { type: "array", items: { type: "boolean" } },
      },
      required: ["n"],
    };
    expect(accepts('{"n":3,"s":"yes","l":[true,false]}', schema)).toBe(true);
    expect(accepts('{"x"', schema)).toBe(false);
    expect(accepts('{"n":3.5', schema)).toBe(false);
    expect(accepts('{"n":"3"', schema)).toBe(false);
    expect(accepts('{"s":"maybe"', schema)).toBe(false);
    expect(accepts('{"s":"no"}', schema)).toBe(false);
    expect(accepts('{"n":1,"n"', schema)).toBe(false);
    expect(accepts('{"l":[1', schema)).toBe(false);
  });

  it("when asked for a completion, then prefix + completion is valid and minimal", () => {
    const schema: JsonSchema = {
      type: "object",
      properties: {
        name: { type: "string" },
        age: { type: "integer" },
        mood: { enum: ["happy", "sad"] },
      },
      required: ["name", "age", "mood"],
    };
    for (const prefix of ["", "{", '{"na', '{"name":"Ad', '{"name":"Ada","age":4', '{"mood":"ha']) {
      const state = new JsonConstraint(schema);
      expect(state.feed(prefix)).toBe(true);
      const text = prefix + state.completion();
      const value = JSON.parse(text);
      expect(Object.keys(value).sort()).toEqual(["age", "mood", "name"]);
    }
    expect(new JsonConstraint().completion()).toBe("{}");
  });
});
