import fc from "fast-check";

/** A JSON Schema node of the bundled spec. */
export type Schema = Record<string, unknown>;

/** The largest list and string a generated valid value has: enough to reach every branch. */
const MAX_ITEMS = 3;
const MAX_CHARS = 24;

/**
 * fast-check arbitraries from the spec's JSON Schemas: `valid` values (what a careful client
 * sends), and `mutated` ones (a careful client's value with one node replaced by something
 * hostile: huge numbers, NUL, long strings, deep nesting, wrong types).
 */
export class SchemaArbitraries {
  readonly #components: Record<string, Record<string, Schema>>;
  /** Values that mean something to the server (a real model id, an entity of the key's), by
   * property name: drawn most of the time, so requests reach past the lookups. */
  hints: Record<string, readonly unknown[]> = {};

  constructor(spec: { components: Record<string, Record<string, Schema>> }) {
    this.#components = spec.components;
  }

  #property(name: string, schema: Schema, depth: number): fc.Arbitrary<unknown> {
    const hinted = this.hints[name];
    const valid = this.valid(schema, depth);
    if (!hinted?.length) return valid;
    return fc.oneof(
      { weight: 4, arbitrary: fc.constantFrom(...hinted) },
      { weight: 1, arbitrary: valid },
    );
  }

  resolve(node: Schema): Schema {
    let current = node;
    for (let hops = 0; typeof current.$ref === "string" && hops < 20; hops++) {
      const [, kind, name] = /^#\/components\/([^/]+)\/(.+)$/.exec(current.$ref as string) ?? [];
      const { $ref: _, ...rest } = current;
      current = { ...this.#components[kind!]![name!]!, ...rest };
    }
    return current;
  }

  /** Valid values with only the required properties at the top: the plainest request. */
  minimal(node: Schema): fc.Arbitrary<unknown> {
    const s = this.resolve(node);
    if (!s.properties) return this.valid(s);
    const required = new Set((s.required ?? []) as string[]);
    const properties = Object.fromEntries(
      Object.entries(s.properties as Record<string, Schema>).filter(([name]) => required.has(name)),
    );
    return this.valid({ ...s, properties, additionalProperties: false });
  }

  valid(node: Schema | undefined, depth = 0): fc.Arbitrary<unknown> {
    if (!node || depth > 8) return fc.constant(null);
    const s = this.resolve(node);
    if ("const" in s) return fc.constant(s.const);
    if (Array.isArray(s.enum)) return fc.constantFrom(...(s.enum as unknown[]));
    for (const key of ["oneOf", "anyOf"] as const) {
      if (Array.isArray(s[key])) {
        return fc.oneof(...(s[key] as Schema[]).map((child) => this.valid(child, depth + 1)));
      }
    }
    if (Array.isArray(s.allOf)) return this.valid((s.allOf as Schema[])[0], depth + 1);
    const types = ([] as string[]).concat((s.type as string | string[] | undefined) ?? []);
    if (types.length === 0) {
      return s.properties ? this.#object(s, depth) : fc.jsonValue({ maxDepth: 2 });
    }
    return fc.oneof(...types.map((type) => this.#typed(type, s, depth)));
  }

  #typed(type: string, s: Schema, depth: number): fc.Arbitrary<unknown> {
    switch (type) {
      case "null":
        return fc.constant(null);
      case "boolean":
        return fc.boolean();
      case "integer":
        return fc.integer({
          min: Math.max(lowerBound(s), -(2 ** 31)),
          max: Math.min(upperBound(s), 2 ** 31),
        });
      case "number":
        return fc.double({
          min: Math.max(lowerBound(s), -1e15),
          max: Math.min(upperBound(s), 1e15),
          noNaN: true,
          noDefaultInfinity: true,
        });
      case "string":
        return this.#string(s);
      case "array":
        return fc.array(this.valid(s.items as Schema, depth + 1), {
          minLength: Number(s.minItems ?? 0),
          maxLength: Math.max(
            Number(s.minItems ?? 0),
            Math.min(Number(s.maxItems ?? MAX_ITEMS), MAX_ITEMS),
          ),
        });
      default:
        return this.#object(s, depth);
    }
  }

  #string(s: Schema): fc.Arbitrary<string> {
    if (s.format === "uuid") return fc.uuid();
    if (s.format === "date-time") {
      return fc
        .date({ min: new Date(2000, 0, 1), max: new Date(2100, 0, 1), noInvalidDate: true })
        .map((d) => d.toISOString());
    }
    const min = Number(s.minLength ?? 0);
    const max = Math.max(min, Math.min(Number(s.maxLength ?? MAX_CHARS), MAX_CHARS));
    if (typeof s.pattern === "string") return matching(s.pattern, min, max);
    return fc.string({ minLength: min, maxLength: max });
  }

  #object(s: Schema, depth: number): fc.Arbitrary<unknown> {
    const properties = (s.properties ?? {}) as Record<string, Schema>;
    const required = new Set((s.required ?? []) as string[]);
    const record = fc.record(
      Object.fromEntries(
        Object.entries(properties).map(([name, child]) => [
          name,
          this.#property(name, child, depth + 1),
        ]),
      ),
      { requiredKeys: [...required].filter((k) => k in properties) },
    );
    const extra = s.additionalProperties;
    if (typeof extra === "object" && extra !== null) {
      return fc
        .tuple(
          record,
          fc.dictionary(
            fc.string({ minLength: 1, maxLength: 8 }),
            this.valid(extra as Schema, depth + 1),
            { maxKeys: 2 },
          ),
        )
        .map(([known, more]) => ({ ...more, ...known }));
    }
    return record;
  }
}

function lowerBound(s: Schema): number {
  if (typeof s.minimum === "number") return s.minimum;
  if (typeof s.exclusiveMinimum === "number") return s.exclusiveMinimum + 1e-9;
  return -1e9;
}

function upperBound(s: Schema): number {
  if (typeof s.maximum === "number") return s.maximum;
  if (typeof s.exclusiveMaximum === "number") return s.exclusiveMaximum - 1e-9;
  return 1e9;
}

/** Strings matching `pattern`. fast-check cannot generate from look-arounds: it generates from
 * the pattern without them and keeps what the real pattern accepts. */
function matching(pattern: string, min: number, max: number): fc.Arbitrary<string> {
  const real = new RegExp(pattern, "u");
  const generable = pattern.replace(/\(\?[=!][^()]*(\([^()]*\)[^()]*)*\)/g, "");
  return fc
    .stringMatching(new RegExp(generable))
    .filter((text) => text.length >= min && text.length <= Math.max(max, 256) && real.test(text));
}

/** Values no careful client sends, each a known way to break a server. */
export const hostile: fc.Arbitrary<unknown> = fc.oneof(
  fc.constantFrom(
    1e308,
    -1e308,
    2 ** 53 + 2,
    -0,
    0.5,
    "",
    "\u0000",
    "a\u0000b",
    "..",
    "../../etc/passwd",
    "%00",
    "\ud800",
    "x".repeat(300_000),
    null,
    true,
    {},
    [],
    [[[[[[]]]]]],
  ),
  fc.integer({ min: 2, max: 200 }).map((depth) => nested(depth)),
  fc.string({ unit: "binary", maxLength: 40 }),
  fc.jsonValue({ maxDepth: 3 }),
);

function nested(depth: number): unknown {
  let value: unknown = 1;
  for (let i = 0; i < depth; i++) value = { a: [value] };
  return value;
}

/** `value` with the node at a chosen position (depth-first, wrapping) replaced by `replacement`. */
export function replaceNode(value: unknown, position: number, replacement: unknown): unknown {
  const nodes: { parent: Record<string, unknown> | unknown[]; key: string | number }[] = [];
  const walk = (node: unknown) => {
    if (Array.isArray(node)) {
      node.forEach((child, i) => {
        nodes.push({ parent: node, key: i });
        walk(child);
      });
    } else if (node !== null && typeof node === "object") {
      for (const [key, child] of Object.entries(node)) {
        nodes.push({ parent: node as Record<string, unknown>, key });
        walk(child);
      }
    }
  };
  const copy = structuredClone(value);
  walk(copy);
  if (nodes.length === 0) return replacement;
  const { parent, key } = nodes[position % nodes.length]!;
  (parent as Record<string | number, unknown>)[key] = replacement;
  return copy;
}
