import { Interpreter } from "@huggingface/jinja";

/**
 * Jinja2's `string` filter on a mapping or a list, as `@huggingface/jinja` lacks it (ADR 63):
 * Jinja2 writes Python's `str()` of the value (`{'name': 'f', 'strict': True}`), which templates
 * that print their tools with `tool | string` (SmolLM3's) show the model. `@huggingface/jinja`
 * refuses the filter on a mapping and writes a list as JSON; this writes both as Python does.
 * The one difference left: a JSON number with a fraction of zero (`1.0`) was a float to Python
 * but is an integer here (`1`), as JavaScript reads JSON.
 */

interface RuntimeValue {
  type: string;
  value: unknown;
}

/** Python's `repr()` of a value a template holds. */
export function pythonRepr(value: RuntimeValue): string {
  switch (value.type) {
    case "StringValue":
      return pythonStringRepr(value.value as string);
    case "IntegerValue":
      return String(value.value);
    case "FloatValue": {
      const n = value.value as number;
      if (Number.isInteger(n)) return `${n}.0`;
      return String(n).replace(/e([+-])(\d)$/, "e$10$2");
    }
    case "BooleanValue":
      return value.value ? "True" : "False";
    case "NullValue":
    case "UndefinedValue":
      return "None";
    case "ArrayValue":
      return `[${(value.value as RuntimeValue[]).map(pythonRepr).join(", ")}]`;
    case "TupleValue": {
      const items = (value.value as RuntimeValue[]).map(pythonRepr);
      return items.length === 1 ? `(${items[0]},)` : `(${items.join(", ")})`;
    }
    case "ObjectValue":
    case "KeywordArgumentsValue":
      return `{${[...(value.value as Map<string, RuntimeValue>)]
        .map(([key, item]) => `${pythonStringRepr(key)}: ${pythonRepr(item)}`)
        .join(", ")}}`;
    default:
      return String(value.value);
  }
}

/** Python's `repr()` of a string: single quotes unless it holds one and no double quote, and
 * escapes for the quote, the backslash and characters Python does not print. */
function pythonStringRepr(text: string): string {
  const quote = text.includes("'") && !text.includes('"') ? '"' : "'";
  let out = quote;
  for (const ch of text) {
    const code = ch.codePointAt(0)!;
    if (ch === quote || ch === "\\") out += `\\${ch}`;
    else if (ch === "\n") out += "\\n";
    else if (ch === "\r") out += "\\r";
    else if (ch === "\t") out += "\\t";
    else if (code < 0x20 || (code >= 0x7f && code <= 0xa0) || code === 0xad) {
      out += `\\x${code.toString(16).padStart(2, "0")}`;
    } else if (code > 0x7f && !printable(code)) {
      out +=
        code > 0xffff
          ? `\\U${code.toString(16).padStart(8, "0")}`
          : `\\u${code.toString(16).padStart(4, "0")}`;
    } else out += ch;
  }
  return out + quote;
}

/** Whether Python prints a character beyond Latin-1 as is: not a separator (other than the
 * space), control, format, surrogate, private-use or unassigned character. */
function printable(code: number): boolean {
  return !/[\p{Z}\p{C}]/u.test(String.fromCodePoint(code));
}

type ApplyFilter = (
  this: Interpreter,
  operand: RuntimeValue,
  filter: { type: string; value?: unknown },
  environment: unknown,
) => RuntimeValue;

const prototype = Interpreter.prototype as unknown as { applyFilter: ApplyFilter };
const original = prototype.applyFilter;
const STRINGS = new Set(["ObjectValue", "KeywordArgumentsValue", "ArrayValue", "TupleValue"]);

prototype.applyFilter = function applyFilter(operand, filter, environment) {
  if (filter.type === "Identifier" && filter.value === "string" && STRINGS.has(operand.type)) {
    // A string value of the library's own kind, holding Python's text.
    const json = original.call(this, operand, { type: "Identifier", value: "tojson" }, environment);
    const StringValue = json.constructor as new (value: string) => RuntimeValue;
    return new StringValue(pythonRepr(operand));
  }
  return original.call(this, operand, filter, environment);
};
