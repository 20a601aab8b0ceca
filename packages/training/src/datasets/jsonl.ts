/**
 * SFT JSONL (the data of `createSftTrainingJob` and `createDataset`, ADR 30): one `SftExample` (`{messages, tools?}`) per non-empty line, checked
 * against the spec's own `SftExample` schema with Ajv; or, for DPO (ADR 69), one `DpoExample`
 * (`{input, preferred_output, non_preferred_output}`) per line. A dataset holds one kind, its
 * first line's; a job's lines must be of its method's. Uploads (`createDataset`) and the training
 * worker both check here, so both name the same first bad line in the same words.
 */

import { Worker } from "node:worker_threads";
import type { ChatMessage } from "@arbor/engine/model";
import type { DpoPair, SftExample as EngineSftExample } from "@arbor/engine/train";
import type { components } from "@arbor/spec/schema";
import { InvalidInputError } from "@arbor/store";
import { type ErrorObject, validator } from "../spec.ts";

/** One line of an SFT dataset, as the spec has it. */
export type SftLine = components["schemas"]["SftExample"];
/** One line of a DPO dataset: a preference pair. */
export type DpoLine = components["schemas"]["DpoExample"];
/** What a dataset's lines are: SFT examples or DPO pairs (a job's `config.method`). */
export type DatasetKind = "sft" | "dpo";
/** A checked line and its kind. */
export type ParsedLine = { kind: "sft"; example: SftLine } | { kind: "dpo"; example: DpoLine };
type SftMessage = components["schemas"]["SftMessage"];
type MessageContent = components["schemas"]["ChatCompletionMessageContent"];

/** The data as a whole is unusable; `line` is null when no single line is to blame (empty). */
export class InvalidDatasetError extends InvalidInputError {
  override name = "InvalidDatasetError";
  readonly line: number | null;
  /** What is wrong, without the line prefix. */
  readonly reason: string;
  constructor(line: number | null, reason: string) {
    super(line === null ? `${reason}.` : `Line ${line}: ${reason}.`, { code: "invalid_dataset" });
    this.line = line;
    this.reason = reason;
  }
}

/** The first bad line (1-based), e.g. `Line 3: not valid JSON.` */
export class DatasetLineError extends InvalidDatasetError {
  override name = "DatasetLineError";
  declare readonly line: number;
}

const validateLine = validator<SftLine>("SftExample");
const validatePair = validator<DpoLine>("DpoExample");

/**
 * Checks every line as an SFT job reads it and calls `visit` with each example and its 1-based
 * line number, in order (`forEachDatasetLine` with kind `sft`).
 */
export function forEachSftLine(
  text: string,
  visit: (example: SftLine, line: number) => void,
): number {
  return forEachDatasetLine(text, (parsed, line) => visit(parsed.example as SftLine, line), "sft");
}

/**
 * Checks every line and calls `visit` with each and its 1-based line number, in order. Each
 * line must be of `kind` (a job's method) or, without it, of the first line's (a dataset holds
 * one kind). Blank lines are skipped (they still count for line numbers); `\r\n` endings and a
 * leading BOM are accepted. Throws `DatasetLineError` at the first bad line, or
 * `InvalidDatasetError` when there is no example. Returns the number of examples (non-empty
 * lines).
 */
export function forEachDatasetLine(
  text: string,
  visit: (parsed: ParsedLine, line: number) => void,
  kind?: DatasetKind,
): number {
  const expected: { kind?: DatasetKind; by: "job" | "dataset" } = kind
    ? { kind, by: "job" }
    : { by: "dataset" };
  let count = 0;
  let start = text.charCodeAt(0) === 0xfeff ? 1 : 0;
  let line = 0;
  while (start <= text.length) {
    let end = text.indexOf("\n", start);
    if (end === -1) end = text.length;
    line++;
    const raw = text.slice(start, end);
    start = end + 1;
    if (raw.trim() === "") continue;
    const parsed = parseDatasetLine(raw, line, expected);
    expected.kind ??= parsed.kind;
    visit(parsed, line);
    count++;
  }
  if (count === 0) throw new InvalidDatasetError(null, "The dataset is empty: no JSONL lines");
  return count;
}

/** Validates an upload without keeping the examples (uploads can be 64 MB): SFT examples or
 * DPO pairs, one kind. */
export function validateSftJsonl(text: string): { lines: number } {
  return { lines: forEachDatasetLine(text, () => {}) };
}

/** Files larger than this are validated on a thread of their own (about 7 ms a MB here). */
export const VALIDATE_OFF_THREAD_CHARS = 1024 * 1024;

let thread: Worker | undefined;
const pending = new Map<number, { resolve: (lines: number) => void; reject: (e: Error) => void }>();
let nextId = 0;

/**
 * `validateSftJsonl`, without holding up the caller's thread for a large file: one worker thread,
 * started on first use, checks it and answers the same count or the same `DatasetLineError`.
 */
export function validateSftJsonlAsync(text: string): Promise<{ lines: number }> {
  if (text.length <= VALIDATE_OFF_THREAD_CHARS) return Promise.resolve(validateSftJsonl(text));
  const worker = validatorThread();
  const id = nextId++;
  return new Promise<number>((resolve, reject) => {
    pending.set(id, { resolve, reject });
    worker.ref();
    worker.postMessage({ id, text });
  }).then((lines) => ({ lines }));
}

function validatorThread(): Worker {
  if (thread) return thread;
  const worker = new Worker(new URL("./validate-thread.ts", import.meta.url));
  worker.unref();
  worker.on(
    "message",
    (reply: {
      id: number;
      lines?: number;
      invalid?: { line: number | null; reason: string };
      error?: string;
    }) => {
      const waiting = pending.get(reply.id);
      if (!waiting) return;
      pending.delete(reply.id);
      if (pending.size === 0) worker.unref();
      if (reply.lines !== undefined) waiting.resolve(reply.lines);
      else if (reply.invalid) {
        const { line, reason } = reply.invalid;
        waiting.reject(
          line === null
            ? new InvalidDatasetError(null, reason)
            : new DatasetLineError(line, reason),
        );
      } else waiting.reject(new Error(`the dataset validator failed: ${reply.error}`));
    },
  );
  const lost = (err: unknown) => {
    if (thread === worker) thread = undefined;
    for (const waiting of pending.values()) {
      waiting.reject(new Error(`the dataset validator's thread stopped: ${String(err)}`));
    }
    pending.clear();
  };
  worker.on("error", lost);
  worker.on("exit", (code) => lost(`exit code ${code}`));
  thread = worker;
  return worker;
}

/** Every example of a file, as the engine trains on it. */
export function sftExamples(text: string): EngineSftExample[] {
  const examples: EngineSftExample[] = [];
  forEachSftLine(text, (line) => examples.push(toEngineExample(line)));
  return examples;
}

/** Every preference pair of a file, as the engine trains on them (a DPO job's data). */
export function dpoPairs(text: string): DpoPair[] {
  const pairs: DpoPair[] = [];
  forEachDatasetLine(text, (parsed) => pairs.push(toEnginePair(parsed.example as DpoLine)), "dpo");
  return pairs;
}

/** Every example of a file read line by line (`\n`-split lines, as a stream yields them): the
 * same checks and errors as `sftExamples`, without the whole file in memory as text. */
export async function sftExamplesFromLines(
  lines: AsyncIterable<string>,
): Promise<EngineSftExample[]> {
  const examples: EngineSftExample[] = [];
  await forEachStreamedLine(lines, "sft", (parsed) =>
    examples.push(toEngineExample(parsed.example as SftLine)),
  );
  return examples;
}

/** `dpoPairs` of a file read line by line. */
export async function dpoPairsFromLines(lines: AsyncIterable<string>): Promise<DpoPair[]> {
  const pairs: DpoPair[] = [];
  await forEachStreamedLine(lines, "dpo", (parsed) =>
    pairs.push(toEnginePair(parsed.example as DpoLine)),
  );
  return pairs;
}

async function forEachStreamedLine(
  lines: AsyncIterable<string>,
  kind: DatasetKind,
  visit: (parsed: ParsedLine) => void,
): Promise<void> {
  let line = 0;
  let count = 0;
  for await (const raw of lines) {
    line++;
    const text = line === 1 && raw.charCodeAt(0) === 0xfeff ? raw.slice(1) : raw;
    if (text.trim() === "") continue;
    visit(parseDatasetLine(text, line, { kind, by: "job" }));
    count++;
  }
  if (count === 0) {
    throw new InvalidDatasetError(null, "The dataset is empty: no JSONL lines");
  }
}

/** One SFT line, checked; throws `DatasetLineError` naming it. */
export function parseSftLine(raw: string, line: number): SftLine {
  return parseDatasetLine(raw, line, { kind: "sft", by: "job" }).example as SftLine;
}

const FORMS: Record<DatasetKind, string> = {
  sft: "an SFT example ({messages})",
  dpo: "a DPO pair ({input, preferred_output, non_preferred_output})",
};

/** The kind a line's keys say it is: a pair has `input` or an output, and no `messages`. */
export function kindOf(value: unknown): DatasetKind {
  if (typeof value !== "object" || value === null || Array.isArray(value) || "messages" in value)
    return "sft";
  return "input" in value || "preferred_output" in value || "non_preferred_output" in value
    ? "dpo"
    : "sft";
}

/**
 * One line, checked against its kind's schema; throws `DatasetLineError` naming it. The kind is
 * what `expected` asks for: a job's method (`by: "job"`), or a dataset's (`by: "dataset"`, its
 * first line's; none yet: the line's own). A line of the other kind is refused as such.
 */
export function parseDatasetLine(
  raw: string,
  line: number,
  expected: { kind?: DatasetKind; by: "job" | "dataset" },
): ParsedLine {
  let value: unknown;
  try {
    value = JSON.parse(raw);
  } catch {
    throw new DatasetLineError(line, "not valid JSON");
  }
  const own = kindOf(value);
  const kind = expected.kind ?? own;
  if (own !== kind) {
    throw new DatasetLineError(
      line,
      expected.by === "dataset"
        ? `this line is ${FORMS[own]} and the dataset's first line ${FORMS[kind]}: a dataset holds one kind`
        : kind === "sft"
          ? `this line is ${FORMS[own]}, and an SFT job trains on {messages} lines: set config.method to "dpo" to train on preference pairs`
          : `this line is ${FORMS[own]}, and a DPO job (config.method "dpo") trains on preference pairs, {input, preferred_output, non_preferred_output}`,
    );
  }
  if (kind === "dpo") {
    if (validatePair(value)) return { kind, example: value };
    throw new DatasetLineError(line, describeFirst(validatePair.errors ?? []));
  }
  if (validateLine(value)) return { kind, example: value };
  throw new DatasetLineError(line, describeFirst(validateLine.errors ?? []));
}

/** A line as the engine renders it: text parts joined, tool calls in the engine's names. */
export function toEngineExample(line: SftLine): EngineSftExample {
  return {
    messages: line.messages.map(toChatMessage),
    ...(line.tools && line.tools.length > 0 ? { tools: line.tools } : {}),
  };
}

/** A pair as the engine trains on it: the prompt's messages, the two answers. */
export function toEnginePair(line: DpoLine): DpoPair {
  const tools = line.input.tools;
  return {
    messages: line.input.messages.map(toChatMessage),
    ...(tools && tools.length > 0 ? { tools } : {}),
    chosen: toChatMessage(line.preferred_output[0]!),
    rejected: toChatMessage(line.non_preferred_output[0]!),
  };
}

function toChatMessage(message: SftMessage): ChatMessage {
  const out: ChatMessage = { role: message.role, content: textOf(message.content) };
  const calls = message.tool_calls ?? [];
  if (calls.length > 0) {
    out.toolCalls = calls.map((call) => ({
      ...(call.id ? { id: call.id } : {}),
      name: call.function.name,
      // OpenAI sends arguments as a JSON string; an object is accepted and serialized.
      arguments:
        typeof call.function.arguments === "string"
          ? call.function.arguments
          : JSON.stringify(call.function.arguments),
    }));
  }
  if (message.tool_call_id) out.toolCallId = message.tool_call_id;
  return out;
}

function textOf(content: MessageContent | null | undefined): string {
  if (content === null || content === undefined) return "";
  return typeof content === "string" ? content : content.map((part) => part.text).join("");
}

/**
 * The one most useful sentence out of Ajv's errors: the deepest place that failed, in the
 * request's own terms (`messages[0].role must be one of …`). A schema node may carry its own
 * wording as `x-error-message` (a string, or one per keyword).
 */
export function describeFirst(errors: readonly ErrorObject[]): string {
  if (errors.length === 0) return "does not match the SftExample schema";
  const depth = (e: ErrorObject) => (e.instancePath === "" ? 0 : e.instancePath.split("/").length);
  const deepest = Math.max(...errors.map(depth));
  const here = errors.filter((e) => depth(e) === deepest);
  const custom = here.filter((e) => customMessage(e) !== undefined).at(-1);
  const chosen = custom ?? here.find((e) => e.keyword !== "if") ?? here[0]!;
  return describe(chosen);
}

function customMessage(error: ErrorObject): string | undefined {
  const custom = (error.parentSchema as Record<string, unknown> | undefined)?.["x-error-message"];
  if (typeof custom === "string") return custom;
  if (custom && typeof custom === "object") {
    const byKeyword = (custom as Record<string, unknown>)[error.keyword];
    if (typeof byKeyword === "string") return byKeyword;
  }
  return undefined;
}

function describe(error: ErrorObject): string {
  const where = pathOf(error.instancePath);
  const subject = where === "" ? "the line" : where;
  const custom = customMessage(error);
  if (custom) return `${subject} ${custom}`;
  const params = error.params as Record<string, unknown>;
  switch (error.keyword) {
    case "required": {
      const missing = String(params.missingProperty);
      return where === "" ? `"${missing}" is required` : `${where}.${missing} is required`;
    }
    case "type":
      return where === ""
        ? 'must be a JSON object with "messages"'
        : `${where} must be ${String(params.type)
            .split(",")
            .map((type) => typeNames[type] ?? type)
            .join(" or ")}`;
    case "enum":
      return `${subject} must be one of ${(params.allowedValues as unknown[]).join(", ")}`;
    case "const":
      return `${subject} must be ${JSON.stringify(params.allowedValue)}`;
    case "minItems":
      return params.limit === 1
        ? `${subject} must be a non-empty array`
        : `${subject} must have at least ${String(params.limit)} items`;
    default:
      return `${subject} ${error.message ?? "is not valid"}`;
  }
}

const typeNames: Record<string, string> = {
  string: "a string",
  array: "an array",
  object: "an object",
  integer: "an integer",
  number: "a number",
  boolean: "a boolean",
};

/** `/messages/0/role` → `messages[0].role`. */
function pathOf(instancePath: string): string {
  return instancePath
    .split("/")
    .slice(1)
    .map((part) => part.replace(/~1/g, "/").replace(/~0/g, "~"))
    .reduce(
      (acc, part) => (/^\d+$/.test(part) ? `${acc}[${part}]` : acc ? `${acc}.${part}` : part),
      "",
    );
}
