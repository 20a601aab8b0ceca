import { describe, expect, it } from "vitest";
import { loadSpec } from "./openapi.ts";

/**
 * Every request schema of the spec is bounded, so no request can make the server do unbounded
 * work or store unbounded values: arrays have `maxItems`, numbers a range, strings a
 * `maxLength` (unless an enum, const or format pins them, or `x-bounded-by: request-body` says
 * the body's size cap bounds it), typed maps `maxProperties` and their keys
 * `propertyNames.maxLength` (or `x-bounded-by: request-body`, where the server bounds what it
 * does with one).
 * Free-form JSON (`additionalProperties: true`, no type) is bounded by the body cap and depth.
 */
const spec = loadSpec() as unknown as {
  paths: Record<string, Record<string, Operation>>;
  components: Record<string, Record<string, unknown>>;
};

interface Operation {
  operationId?: string;
  parameters?: Schema[];
  requestBody?: Schema;
}
type Schema = Record<string, unknown>;

function resolve(node: Schema): Schema {
  let current = node;
  for (let hops = 0; typeof current.$ref === "string" && hops < 20; hops++) {
    const [, kind, name] = /^#\/components\/([^/]+)\/(.+)$/.exec(current.$ref as string) ?? [];
    current = { ...(spec.components[kind!]?.[name!] as Schema), ...withoutRef(current) };
  }
  return current;
}

function withoutRef(node: Schema): Schema {
  const { $ref: _, ...rest } = node;
  return rest;
}

function unbounded(schema: Schema, at: string, seen: Set<unknown>, out: string[]): void {
  if (seen.has(schema)) return;
  seen.add(schema);
  const s = resolve(schema);
  const types = ([] as unknown[]).concat(s.type ?? []);
  const pinned = s.enum !== undefined || s.const !== undefined || s.format !== undefined;
  if (types.includes("array") && s.maxItems === undefined)
    out.push(`${at}: array without maxItems`);
  if (types.includes("integer") || types.includes("number")) {
    if (s.maximum === undefined && s.exclusiveMaximum === undefined)
      out.push(`${at}: number without maximum`);
    if (s.minimum === undefined && s.exclusiveMinimum === undefined)
      out.push(`${at}: number without minimum`);
  }
  // Message text is bounded by the body cap alone: a maxLength there costs a pass over the text.
  const byBody = s["x-bounded-by"] === "request-body";
  if (types.includes("string") && s.maxLength === undefined && !pinned && !byBody)
    out.push(`${at}: string without maxLength`);
  const extra = s.additionalProperties;
  if (typeof extra === "object" && extra !== null) {
    if (s.maxProperties === undefined && !byBody) out.push(`${at}: map without maxProperties`);
    const names = s.propertyNames as Schema | undefined;
    if (names?.maxLength === undefined && !byBody)
      out.push(`${at}: map without propertyNames.maxLength`);
    unbounded(extra as Schema, `${at}{}`, seen, out);
  }
  for (const [name, child] of Object.entries((s.properties ?? {}) as Record<string, Schema>))
    unbounded(child, `${at}.${name}`, seen, out);
  if (s.items) unbounded(s.items as Schema, `${at}[]`, seen, out);
  for (const key of ["if", "then", "else"])
    if (s[key]) unbounded(s[key] as Schema, `${at}|${key}`, seen, out);
  for (const key of ["oneOf", "anyOf", "allOf"])
    for (const [i, child] of ((s[key] ?? []) as Schema[]).entries())
      unbounded(child, `${at}|${key}${i}`, seen, out);
}

describe("the spec's request schemas", () => {
  it("when any operation's body or parameter is read, then every list, number, string and map in it is bounded", () => {
    const problems: string[] = [];
    for (const item of Object.values(spec.paths)) {
      for (const op of Object.values(item)) {
        if (typeof op !== "object" || !op.operationId) continue;
        for (const parameter of [
          ...((item.parameters as unknown as Schema[]) ?? []),
          ...(op.parameters ?? []),
        ]) {
          const p = resolve(parameter);
          unbounded(p.schema as Schema, `${op.operationId} ${p.in} ${p.name}`, new Set(), problems);
        }
        const content = (resolve(op.requestBody ?? {}).content ?? {}) as Record<string, Schema>;
        for (const [type, media] of Object.entries(content)) {
          if (media.schema)
            unbounded(
              media.schema as Schema,
              `${op.operationId} body (${type})`,
              new Set(),
              problems,
            );
        }
      }
    }
    expect(problems).toEqual([]);
  });
});

/** Every schema node of the document, with where it is; examples are values, not schemas. */
function* schemaNodes(node: unknown, at: string): Generator<[Schema, string]> {
  if (typeof node !== "object" || node === null) return;
  if (Array.isArray(node)) {
    for (const [i, child] of node.entries()) yield* schemaNodes(child, `${at}[${i}]`);
    return;
  }
  yield [node as Schema, at];
  for (const [key, child] of Object.entries(node)) {
    if (key === "example" || key === "examples" || key === "x-codeSamples") continue;
    yield* schemaNodes(child, `${at}.${key}`);
  }
}

describe("the spec's schemas", () => {
  it("when a schema says it is an array, then it says what its items are, as OpenAPI linters require", () => {
    const problems: string[] = [];
    for (const [node, at] of schemaNodes(spec, "#")) {
      const types = ([] as unknown[]).concat(node.type ?? []);
      if (types.includes("array") && node.items === undefined && node.prefixItems === undefined)
        problems.push(at);
    }
    expect(problems).toEqual([]);
  });
});
