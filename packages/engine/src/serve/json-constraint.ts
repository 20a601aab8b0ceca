/**
 * An incremental, character-level JSON recogniser with an optional schema subset, used to mask
 * tokens during constrained decoding. It only ever accepts prefixes that can still be completed,
 * and can produce the shortest completion so generation can close the value before max_tokens.
 *
 * Schema subset: object (properties, required; no additional properties), array (items),
 * string (optionally enum), number, integer, boolean, null, `enum` of strings, and a choice of
 * objects told apart by one property (a discriminated `oneOf`/`anyOf`: the telling property is
 * written first, and the rest of the object follows the variant it names).
 */

export type JsonSchema =
  | { type: "object"; properties?: Record<string, JsonSchema>; required?: string[] }
  | { type: "object"; discriminator: string; oneOf: JsonSchema[] }
  | { type: "array"; items?: JsonSchema }
  | { type: "string"; enum?: string[] }
  | { type: "number" }
  | { type: "integer" }
  | { type: "boolean" }
  | { type: "null" }
  | { enum: string[] }
  | Record<string, never>;

/** Keywords that only describe a schema: accepted and ignored. */
const ANNOTATIONS = new Set(["title", "description", "$schema", "$comment", "default", "examples"]);
const TYPES = new Set(["object", "array", "string", "number", "integer", "boolean", "null"]);

/** A schema the engine cannot honour; `path` names where (e.g. `schema.properties.a.minimum`). */
export class UnsupportedSchemaError extends Error {
  override name = "UnsupportedSchemaError";
  readonly path: string;
  constructor(path: string, why: string) {
    super(`${path} ${why}`);
    this.path = path;
  }
}

/**
 * A JSON Schema as the constraint honours it, or an `UnsupportedSchemaError` naming the first
 * keyword it would otherwise ignore: decoding never silently drops a constraint. Supported: one
 * `type`; `properties`, `required` and `additionalProperties: false` on objects; `items` on
 * arrays; a string `enum`; annotations (title, description, …).
 */
export function parseJsonSchema(value: unknown, path = "schema"): JsonSchema {
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    throw new UnsupportedSchemaError(path, "must be an object");
  }
  const schema = value as Record<string, unknown>;
  const out: Record<string, unknown> = {};
  for (const [key, v] of Object.entries(schema)) {
    const at = `${path}.${key}`;
    if (ANNOTATIONS.has(key)) continue;
    switch (key) {
      case "type":
        if (typeof v !== "string" || !TYPES.has(v)) {
          throw new UnsupportedSchemaError(
            at,
            "must be one type name (type lists are not supported)",
          );
        }
        out.type = v;
        break;
      case "enum":
        if (!Array.isArray(v) || v.length === 0 || !v.every((e) => typeof e === "string")) {
          throw new UnsupportedSchemaError(at, "must be a non-empty list of strings");
        }
        out.enum = v;
        break;
      case "required":
        if (!Array.isArray(v) || !v.every((e) => typeof e === "string")) {
          throw new UnsupportedSchemaError(at, "must be a list of property names");
        }
        out.required = v;
        break;
      case "properties": {
        if (typeof v !== "object" || v === null || Array.isArray(v)) {
          throw new UnsupportedSchemaError(at, "must be an object");
        }
        out.properties = Object.fromEntries(
          Object.entries(v).map(([name, sub]) => [name, parseJsonSchema(sub, `${at}.${name}`)]),
        );
        break;
      }
      case "items":
        out.items = parseJsonSchema(v, at);
        break;
      case "discriminator":
        // A parsed choice's telling property, checked with its oneOf.
        if (!("oneOf" in schema || "anyOf" in schema)) {
          throw new UnsupportedSchemaError(at, "is not supported");
        }
        break;
      case "oneOf":
      case "anyOf":
        return choiceOf(schema, key, v, path);
      case "additionalProperties":
        // Only the listed properties are ever generated, so `false` is what the constraint does.
        if (v !== false) throw new UnsupportedSchemaError(at, "is supported only as false");
        break;
      default:
        throw new UnsupportedSchemaError(at, "is not supported");
    }
  }
  const type = out.type;
  if ("enum" in out && type !== undefined && type !== "string") {
    throw new UnsupportedSchemaError(`${path}.enum`, "is supported only for strings");
  }
  for (const key of ["properties", "required"]) {
    if (key in out && type !== "object") {
      throw new UnsupportedSchemaError(`${path}.${key}`, 'needs "type": "object"');
    }
  }
  if ("items" in out && type !== "array") {
    throw new UnsupportedSchemaError(`${path}.items`, 'needs "type": "array"');
  }
  if (schema.additionalProperties === false && type === "object" && !out.properties) {
    out.properties = {};
  }
  return out as JsonSchema;
}

/**
 * A `oneOf`/`anyOf` the constraint can enforce exactly: objects that all require one property
 * (the first such in the first variant's order) whose values, a string enum in each, are
 * distinct across them. The telling property is generated first, then the variant it names.
 */
function choiceOf(
  schema: Record<string, unknown>,
  key: string,
  value: unknown,
  path: string,
): JsonSchema {
  const at = `${path}.${key}`;
  for (const other of Object.keys(schema)) {
    if (other === key || ANNOTATIONS.has(other)) continue;
    if (other === "type" && schema.type === "object") continue;
    // A parsed choice parses to itself: its telling property is checked below.
    if (other === "discriminator" && typeof schema.discriminator === "string") continue;
    throw new UnsupportedSchemaError(`${path}.${other}`, `cannot be combined with ${key}`);
  }
  if (!Array.isArray(value) || value.length === 0) {
    throw new UnsupportedSchemaError(at, "must be a non-empty list of schemas");
  }
  const variants = value.map((v, i) => parseJsonSchema(v, `${at}[${i}]`));
  const valuesOf = (variant: JsonSchema, name: string): string[] | null => {
    if (!("type" in variant) || variant.type !== "object" || "oneOf" in variant) return null;
    if (!variant.required?.includes(name)) return null;
    return enumOf(variant.properties?.[name]);
  };
  const first = variants[0]!;
  const candidates = "properties" in first && first.properties ? Object.keys(first.properties) : [];
  const discriminator = candidates.find((name) => {
    const lists = variants.map((variant) => valuesOf(variant, name));
    if (lists.some((list) => list === null)) return false;
    const all = lists.flatMap((list) => list!);
    return new Set(all).size === all.length;
  });
  if (
    discriminator === undefined ||
    ("discriminator" in schema && schema.discriminator !== discriminator)
  ) {
    throw new UnsupportedSchemaError(
      at,
      "is supported only as a choice of objects that all require one property whose string enum values tell them apart",
    );
  }
  return { type: "object", discriminator, oneOf: variants };
}

type Frame =
  | { kind: "value"; schema: JsonSchema | undefined }
  | {
      kind: "object";
      schema: JsonSchema | undefined;
      /** key: expecting `"` or `}`; colon; comma: expecting `,` or `}`; keyAfterComma: expecting `"`. */
      state: "key" | "colon" | "comma" | "keyAfterComma";
      seen: string[];
      key: string;
    }
  | { kind: "array"; schema: JsonSchema | undefined; state: "first" | "comma" | "next" }
  | {
      kind: "string";
      options: string[] | null;
      isKey: boolean;
      text: string;
      escape: "" | "\\" | "u0" | "u1" | "u2" | "u3";
    }
  | { kind: "number"; integer: boolean; state: NumberState }
  | { kind: "literal"; rest: string };

type NumberState = "start" | "minus" | "zero" | "int" | "dot" | "frac" | "e" | "esign" | "exp";

const WHITESPACE = " \t\n\r";
const DIGITS = "0123456789";

export class JsonConstraint {
  private stack: Frame[];
  private done = false;
  private blank = 0;

  constructor(schema?: JsonSchema, stack?: Frame[]) {
    this.stack = stack ?? [{ kind: "value", schema: schema ?? { type: "object" } }];
  }

  clone(): JsonConstraint {
    const copy = new JsonConstraint(undefined, this.stack.map(cloneFrame));
    copy.done = this.done;
    copy.blank = this.blank;
    return copy;
  }

  /** True inside a string value with no enum or key options (any plain text continues it). */
  get inFreeString(): boolean {
    const top = this.stack[this.stack.length - 1];
    return top?.kind === "string" && top.options === null && top.escape === "";
  }

  /** True once a complete top-level value has been read. */
  get complete(): boolean {
    if (this.done) return true;
    const top = this.stack[0];
    return this.stack.length === 1 && top?.kind === "number" && numberComplete(top);
  }

  /** Feeds text; returns false (leaving the state undefined) if it makes the prefix invalid. */
  feed(text: string): boolean {
    for (const ch of text) if (!this.feedChar(ch)) return false;
    return true;
  }

  private feedChar(ch: string): boolean {
    if (this.done) return false;
    const top = this.stack[this.stack.length - 1];
    if (!top) return false;
    const outside = top.kind !== "string";
    if (top.kind === "number" && WHITESPACE.includes(ch)) return this.endNumber(ch);
    if (outside && WHITESPACE.includes(ch) && top.kind !== "literal") {
      this.blank++;
      return this.blank <= 1;
    }
    if (outside) this.blank = 0;
    switch (top.kind) {
      case "value":
        return this.startValue(top.schema, ch);
      case "literal":
        if (top.rest[0] !== ch) return false;
        top.rest = top.rest.slice(1);
        if (top.rest.length === 0) this.finishValue();
        return true;
      case "number":
        return this.numberChar(top, ch);
      case "string":
        return this.stringChar(top, ch);
      case "array":
        if (top.state === "first" && ch === "]") return this.close();
        if (top.state === "comma") {
          if (ch === "]") return this.close();
          if (ch === ",") {
            top.state = "next";
            return true;
          }
          return false;
        }
        top.state = "comma";
        this.stack.push({ kind: "value", schema: itemsOf(top.schema) });
        return this.feedChar(ch);
      case "object":
        return this.objectChar(top, ch);
    }
  }

  private startValue(schema: JsonSchema | undefined, ch: string): boolean {
    const types = allowedTypes(schema);
    this.stack.pop();
    if (ch === "{" && types.has("object")) {
      this.stack.push({ kind: "object", schema, state: "key", seen: [], key: "" });
      return true;
    }
    if (ch === "[" && types.has("array")) {
      this.stack.push({ kind: "array", schema, state: "first" });
      return true;
    }
    if (ch === '"' && types.has("string")) {
      this.stack.push({
        kind: "string",
        options: enumOf(schema),
        isKey: false,
        text: "",
        escape: "",
      });
      return true;
    }
    if ((ch === "-" || DIGITS.includes(ch)) && (types.has("number") || types.has("integer"))) {
      const frame: Frame = { kind: "number", integer: !types.has("number"), state: "start" };
      this.stack.push(frame);
      return this.numberChar(frame, ch);
    }
    const literals: Record<string, string> = { t: "rue", f: "alse", n: "ull" };
    if (ch in literals && types.has(ch === "n" ? "null" : "boolean")) {
      this.stack.push({ kind: "literal", rest: literals[ch]! });
      return true;
    }
    return false;
  }

  private close(): boolean {
    this.finishValue();
    return true;
  }

  /** Pops a finished value; the parent already moved to its after-value state. */
  private finishValue(): void {
    this.stack.pop();
    if (this.stack.length === 0) this.done = true;
  }

  private numberChar(frame: Extract<Frame, { kind: "number" }>, ch: string): boolean {
    const digit = DIGITS.includes(ch);
    const to = (state: NumberState) => {
      frame.state = state;
      return true;
    };
    switch (frame.state) {
      case "start":
        if (ch === "-") return to("minus");
        if (ch === "0") return to("zero");
        return digit && to("int");
      case "minus":
        if (ch === "0") return to("zero");
        return digit && to("int");
      case "int":
        if (digit) return true;
        return this.afterInteger(frame, ch);
      case "zero":
        return this.afterInteger(frame, ch);
      case "dot":
        return digit && to("frac");
      case "frac":
        if (digit) return true;
        if (ch === "e" || ch === "E") return to("e");
        return this.endNumber(ch);
      case "e":
        if (ch === "+" || ch === "-") return to("esign");
        return digit && to("exp");
      case "esign":
        return digit && to("exp");
      case "exp":
        if (digit) return true;
        return this.endNumber(ch);
    }
  }

  private afterInteger(frame: Extract<Frame, { kind: "number" }>, ch: string): boolean {
    if (!frame.integer && ch === ".") {
      frame.state = "dot";
      return true;
    }
    if (!frame.integer && (ch === "e" || ch === "E")) {
      frame.state = "e";
      return true;
    }
    return this.endNumber(ch);
  }

  /** A character that cannot continue a complete number ends it and goes to the parent. */
  private endNumber(ch: string): boolean {
    const top = this.stack[this.stack.length - 1];
    if (top?.kind !== "number" || !numberComplete(top)) return false;
    this.finishValue();
    if (this.done) return false;
    return this.feedChar(ch);
  }

  private stringChar(frame: Extract<Frame, { kind: "string" }>, ch: string): boolean {
    if (frame.escape === "\\") {
      if (!'"\\/bfnrtu'.includes(ch)) return false;
      if (frame.options) return false;
      frame.escape = ch === "u" ? "u0" : "";
      frame.text += "?";
      return true;
    }
    if (frame.escape !== "") {
      if (!/[0-9a-fA-F]/.test(ch)) return false;
      frame.escape = frame.escape === "u3" ? "" : (`u${Number(frame.escape[1]) + 1}` as "u1");
      return true;
    }
    if (ch === "\\") {
      frame.escape = "\\";
      return !frame.options;
    }
    if (ch === '"') {
      if (frame.options && !frame.options.includes(frame.text)) return false;
      this.stack.pop();
      const parent = this.stack[this.stack.length - 1];
      if (frame.isKey && parent?.kind === "object") {
        parent.key = frame.text;
        parent.seen.push(frame.text);
        parent.state = "colon";
        return true;
      }
      if (this.stack.length === 0) this.done = true;
      // The telling property of a choice names the variant the rest of the object follows.
      else if (parent?.kind === "object" && isChoice(parent.schema)) {
        const choice = parent.schema;
        if (parent.key === choice.discriminator) {
          parent.schema = choice.oneOf.find((variant) =>
            enumOf(propertiesOf(variant)?.[choice.discriminator])?.includes(frame.text),
          );
        }
      }
      return true;
    }
    if (ch.charCodeAt(0) < 0x20) return false;
    frame.text += ch;
    return !frame.options || frame.options.some((o) => o.startsWith(frame.text));
  }

  private objectChar(frame: Extract<Frame, { kind: "object" }>, ch: string): boolean {
    const props = propertiesOf(frame.schema);
    const missing = requiredOf(frame.schema).filter((k) => !frame.seen.includes(k));
    switch (frame.state) {
      case "key":
      case "keyAfterComma":
        if (ch === "}" && frame.state === "key" && missing.length === 0) return this.close();
        if (ch !== '"') return false;
        {
          const options = props ? Object.keys(props).filter((k) => !frame.seen.includes(k)) : null;
          if (options && options.length === 0) return false;
          this.stack.push({ kind: "string", options, isKey: true, text: "", escape: "" });
        }
        return true;
      case "colon":
        if (ch !== ":") return false;
        frame.state = "comma";
        this.stack.push({ kind: "value", schema: props ? props[frame.key] : undefined });
        return true;
      case "comma":
        if (ch === "}" && missing.length === 0) return this.close();
        if (ch === ",") {
          const remaining = props
            ? Object.keys(props).filter((k) => !frame.seen.includes(k))
            : null;
          if (remaining && remaining.length === 0) return false;
          frame.state = "keyAfterComma";
          return true;
        }
        return false;
    }
  }

  /** The next character of the shortest valid completion, or null when complete. */
  nextForcedChar(): string | null {
    if (this.done) return null;
    const top = this.stack[this.stack.length - 1];
    if (!top) return null;
    switch (top.kind) {
      case "value":
        return minimalValueStart(top.schema);
      case "literal":
        return top.rest[0] ?? null;
      case "number":
        if (!numberComplete(top)) return "0";
        if (this.stack.length === 1) return null;
        return this.closingChar(this.stack[this.stack.length - 2]!);
      case "string": {
        if (top.escape === "\\") return "n";
        if (top.escape !== "") return "0";
        if (!top.options) return '"';
        if (top.options.includes(top.text)) return '"';
        const option = top.options
          .filter((o) => o.startsWith(top.text))
          .sort((a, b) => a.length - b.length)[0];
        return option?.[top.text.length] ?? '"';
      }
      default:
        return this.closingChar(top);
    }
  }

  private closingChar(frame: Frame): string {
    if (frame.kind === "array")
      return frame.state === "next" ? minimalValueStart(itemsOf(frame.schema)) : "]";
    if (frame.kind !== "object") return "";
    const missing = requiredOf(frame.schema).filter((k) => !frame.seen.includes(k));
    switch (frame.state) {
      case "key":
        return missing.length > 0 ? '"' : "}";
      case "keyAfterComma":
        return '"';
      case "colon":
        return ":";
      case "comma":
        return missing.length > 0 ? "," : "}";
    }
  }

  /** The shortest text that completes the value from here. */
  completion(limit = 10_000): string {
    const probe = this.clone();
    let text = "";
    while (!probe.complete && text.length < limit) {
      const ch = probe.nextForcedChar();
      if (ch === null) break;
      // Inside a key string with options, prefer a missing required key.
      const top = probe.stack[probe.stack.length - 1];
      if (top?.kind === "string" && top.isKey && top.options && top.text === "") {
        const parent = probe.stack[probe.stack.length - 2];
        if (parent?.kind === "object") {
          const missing = requiredOf(parent.schema).filter((k) => !parent.seen.includes(k));
          const preferred = missing[0] ?? top.options[0];
          if (preferred !== undefined) {
            for (const c of `${preferred}"`) {
              if (!probe.feedChar(c)) throw new Error("json: completion failed");
              text += c;
            }
            continue;
          }
        }
      }
      if (!probe.feedChar(ch))
        throw new Error(`json: completion failed at ${JSON.stringify(text + ch)}`);
      text += ch;
    }
    return text;
  }
}

function numberComplete(frame: Extract<Frame, { kind: "number" }>): boolean {
  return (
    frame.state === "int" ||
    frame.state === "zero" ||
    frame.state === "frac" ||
    frame.state === "exp"
  );
}

function cloneFrame(frame: Frame): Frame {
  if (frame.kind === "object") return { ...frame, seen: [...frame.seen] };
  return { ...frame };
}

function allowedTypes(schema: JsonSchema | undefined): Set<string> {
  if (!schema || !("type" in schema || "enum" in schema)) {
    return new Set(["object", "array", "string", "number", "integer", "boolean", "null"]);
  }
  if ("enum" in schema && !("type" in schema)) return new Set(["string"]);
  const type = (schema as { type: string }).type;
  if (type === "number") return new Set(["number", "integer"]);
  return new Set([type]);
}

function enumOf(schema: JsonSchema | undefined): string[] | null {
  return schema && "enum" in schema && Array.isArray(schema.enum) ? schema.enum : null;
}

function itemsOf(schema: JsonSchema | undefined): JsonSchema | undefined {
  return schema && "type" in schema && schema.type === "array" ? schema.items : undefined;
}

function isChoice(
  schema: JsonSchema | undefined,
): schema is Extract<JsonSchema, { discriminator: string }> {
  return schema !== undefined && "discriminator" in schema;
}

/** An object's properties; before a choice's variant is named, only its telling property. */
function propertiesOf(schema: JsonSchema | undefined): Record<string, JsonSchema> | null {
  if (isChoice(schema)) {
    const values = schema.oneOf.flatMap(
      (variant) => enumOf(propertiesOf(variant)?.[schema.discriminator]) ?? [],
    );
    return { [schema.discriminator]: { enum: values } };
  }
  return schema && "type" in schema && schema.type === "object" && "properties" in schema
    ? (schema.properties ?? null)
    : null;
}

function requiredOf(schema: JsonSchema | undefined): string[] {
  if (isChoice(schema)) return [schema.discriminator];
  return schema && "type" in schema && schema.type === "object" && "required" in schema
    ? (schema.required ?? [])
    : [];
}

function minimalValueStart(schema: JsonSchema | undefined): string {
  const types = allowedTypes(schema);
  if (types.has("object") && types.size === 1) return "{";
  if (types.has("null")) return "n";
  if (types.has("string")) return '"';
  if (types.has("integer") || types.has("number")) return "0";
  if (types.has("boolean")) return "f";
  if (types.has("array")) return "[";
  return "{";
}
