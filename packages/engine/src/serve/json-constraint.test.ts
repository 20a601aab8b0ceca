import { describe, expect, it } from "vitest";
import {
  JsonConstraint,
  type JsonSchema,
  parseJsonSchema,
  UnsupportedSchemaError,
} from "./json-constraint.ts";

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

describe("parseJsonSchema", () => {
  it("when the schema uses only what the constraint honours, then it is kept (annotations dropped)", () => {
    expect(
      parseJsonSchema({
        title: "Answer",
        type: "object",
        properties: {
          answer: { type: "integer", description: "the sum" },
          unit: { type: "string", enum: ["m", "s"] },
          tags: { type: "array", items: { type: "string" } },
        },
        required: ["answer"],
        additionalProperties: false,
      }),
    ).toEqual({
      type: "object",
      properties: {
        answer: { type: "integer" },
        unit: { type: "string", enum: ["m", "s"] },
        tags: { type: "array", items: { type: "string" } },
      },
      required: ["answer"],
    });
  });

  it("when a oneOf or anyOf is a choice of objects told apart by a property, then the telling property comes first and the rest follows the variant it names", () => {
    const schema = parseJsonSchema({
      description: "a call",
      oneOf: [
        {
          type: "object",
          properties: {
            name: { type: "string", enum: ["add"] },
            arguments: { type: "object", properties: { a: { type: "integer" } }, required: ["a"] },
          },
          required: ["name", "arguments"],
        },
        {
          type: "object",
          properties: {
            name: { enum: ["say", "shout"] },
            arguments: { type: "object", properties: { text: { type: "string" } } },
          },
          required: ["arguments", "name"],
        },
      ],
    });
    expect(schema).toMatchObject({ type: "object", discriminator: "name" });
    const accepts = (text: string) => new JsonConstraint(schema).feed(text);
    expect(accepts('{"name": "add", "arguments": {"a": 1}}')).toBe(true);
    expect(accepts('{"name": "shout", "arguments": {"text": "hi"}}')).toBe(true);
    // The arguments follow the function named, not another's.
    expect(accepts('{"name": "add", "arguments": {"text"')).toBe(false);
    expect(accepts('{"name": "say", "arguments": {"a"')).toBe(false);
    expect(accepts('{"name": "add", "arguments": {}')).toBe(false);
    expect(accepts('{"name": "sub"')).toBe(false);
    // The telling property first; the variant's required ones before the end.
    expect(accepts('{"arguments"')).toBe(false);
    expect(accepts('{"name": "add"}')).toBe(false);
    const done = new JsonConstraint(schema);
    expect(done.feed('{"name": "say", "arguments": {"text": "hi"}}')).toBe(true);
    expect(done.complete).toBe(true);
    // The shortest completion names a variant and completes it.
    for (const prefix of ["", "{", '{"name": "a', '{"name": "say", "arguments": {"te']) {
      const c = new JsonConstraint(schema);
      expect(c.feed(prefix)).toBe(true);
      const whole = prefix + c.completion();
      expect(new JsonConstraint(schema).feed(whole) && JSON.parse(whole)).toBeTruthy();
    }
    const variants = "oneOf" in schema ? schema.oneOf : [];
    expect(parseJsonSchema({ type: "object", anyOf: variants })).toEqual(schema);
    // A parsed choice parses to itself (a tool call's choice holds parsed parameters).
    expect(parseJsonSchema(schema)).toEqual(schema);
    expect(parseJsonSchema({ oneOf: [variants[0]] })).toMatchObject({ discriminator: "name" });
  });

  it.each([
    [
      {
        oneOf: [
          { type: "object", properties: { k: { enum: ["a"] } }, required: ["k"] },
          { type: "object", properties: { k: { enum: ["a", "b"] } }, required: ["k"] },
        ],
      },
      "schema.oneOf is supported only as a choice of objects that all require one property whose string enum values tell them apart",
    ],
    [
      {
        anyOf: [
          { type: "object", properties: { k: { enum: ["a"] } }, required: ["k"] },
          { type: "object", properties: { k: { enum: ["b"] } } },
        ],
      },
      "schema.anyOf is supported only as a choice of objects that all require one property whose string enum values tell them apart",
    ],
    [
      { type: "object", properties: {}, oneOf: [{ type: "object" }] },
      "schema.properties cannot be combined with oneOf",
    ],
    [{ oneOf: [] }, "schema.oneOf must be a non-empty list of schemas"],
  ])("when a choice %j cannot be told apart, then it is refused naming it", (schema, message) => {
    expect(() => parseJsonSchema(schema)).toThrow(message);
  });

  it("when additionalProperties is false with no properties, then only {} is generated", () => {
    const schema = parseJsonSchema({ type: "object", additionalProperties: false });
    expect(new JsonConstraint(schema).feed('{"')).toBe(false);
    expect(new JsonConstraint(schema).feed("{}")).toBe(true);
  });

  it.each([
    [{ type: "integer", minimum: 0 }, "schema.minimum is not supported"],
    [
      { type: ["string", "null"] },
      "schema.type must be one type name (type lists are not supported)",
    ],
    [
      { type: "object", properties: { a: { anyOf: [{ type: "string" }] } } },
      "schema.properties.a.anyOf is supported only as a choice of objects that all require one property whose string enum values tell them apart",
    ],
    [
      { type: "object", additionalProperties: { type: "string" } },
      "schema.additionalProperties is supported only as false",
    ],
    [{ type: "integer", enum: ["1"] }, "schema.enum is supported only for strings"],
    [{ properties: {} }, 'schema.properties needs "type": "object"'],
    ["object", "schema must be an object"],
  ])("when the schema has %j, then it is refused naming the keyword", (schema, message) => {
    expect(() => parseJsonSchema(schema)).toThrow(UnsupportedSchemaError);
    expect(() => parseJsonSchema(schema)).toThrow(message);
  });
});
