/**
 * SFT JSONL (CONTRACT §5): one `{messages, tools?}` object per non-empty line. Used on upload
 * (`createDataset`) and by the training worker before it takes a step, so both name the same
 * first bad line in the same words.
 */

export const SFT_ROLES = ["system", "developer", "user", "assistant", "tool"] as const;
export type SftRole = (typeof SFT_ROLES)[number];

export interface SftToolCall {
  id?: string;
  name: string;
  /** The arguments as sent: a JSON string, as OpenAI has it. */
  arguments: string;
}

/** One message, normalized: text parts are joined into `content`, and the tool-call fields use
 * the engine's names (`ChatMessage` in @arbor/engine), so it can be rendered as it is. */
export interface SftMessage {
  role: SftRole;
  content: string;
  toolCalls?: SftToolCall[];
  toolCallId?: string;
}

export interface SftExample {
  messages: SftMessage[];
  /** The line's `tools`, as sent (function definitions). */
  tools?: Record<string, unknown>[];
  /** 1-based line number in the file. */
  line: number;
}

/** The data as a whole is unusable; `line` is null when no single line is to blame (empty). */
export class InvalidDatasetError extends Error {
  readonly line: number | null;
  /** What is wrong, without the line prefix. */
  readonly reason: string;
  constructor(line: number | null, reason: string) {
    super(line === null ? `${reason}.` : `Line ${line}: ${reason}.`);
    this.name = "InvalidDatasetError";
    this.line = line;
    this.reason = reason;
  }
}

/** The first bad line (1-based), e.g. `Line 3: not valid JSON.` */
export class DatasetLineError extends InvalidDatasetError {
  declare readonly line: number;
  constructor(line: number, reason: string) {
    super(line, reason);
    this.name = "DatasetLineError";
  }
}

/**
 * Checks every line and calls `visit` with each example, in order. Blank lines are skipped (they
 * still count for line numbers); `\r\n` endings and a leading BOM are accepted. Throws
 * `DatasetLineError` at the first bad line, or `InvalidDatasetError` when there is no example.
 * Returns the number of examples (non-empty lines).
 */
export function forEachSftExample(text: string, visit: (example: SftExample) => void): number {
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
    visit(parseLine(raw, line));
    count++;
  }
  if (count === 0) throw new InvalidDatasetError(null, "The dataset is empty: no JSONL lines");
  return count;
}

/** Parses a whole file for training: every example, and how many lines held one. */
export function parseSftJsonl(text: string): { examples: SftExample[]; lines: number } {
  const examples: SftExample[] = [];
  const lines = forEachSftExample(text, (example) => examples.push(example));
  return { examples, lines };
}

/** Validates without keeping the examples (uploads can be 64 MB). */
export function validateSftJsonl(text: string): { lines: number } {
  return { lines: forEachSftExample(text, () => {}) };
}

function parseLine(raw: string, line: number): SftExample {
  let value: unknown;
  try {
    value = JSON.parse(raw);
  } catch {
    throw new DatasetLineError(line, "not valid JSON");
  }
  const fail = (reason: string): never => {
    throw new DatasetLineError(line, reason);
  };
  if (!isObject(value)) return fail("must be a JSON object with `messages`");
  const { messages, tools } = value;
  if (!Array.isArray(messages) || messages.length === 0) {
    return fail('"messages" must be a non-empty array');
  }
  const parsed = messages.map((m, i) => parseMessage(m, `messages[${i}]`, fail));
  if (!parsed.some((m) => m.role === "assistant")) fail("no assistant message to learn from");
  const example: SftExample = { messages: parsed, line };
  if (tools !== undefined && tools !== null) {
    if (!Array.isArray(tools)) fail('"tools" must be an array');
    (tools as unknown[]).forEach((tool, i) => {
      if (!isObject(tool)) fail(`tools[${i}] must be an object`);
    });
    example.tools = tools as Record<string, unknown>[];
  }
  return example;
}

function parseMessage(value: unknown, at: string, fail: (reason: string) => never): SftMessage {
  if (!isObject(value)) return fail(`${at} must be an object with "role" and "content"`);
  const role = value.role;
  if (typeof role !== "string" || !(SFT_ROLES as readonly string[]).includes(role)) {
    return fail(`${at}.role must be one of ${SFT_ROLES.join(", ")}`);
  }
  const message: SftMessage = { role: role as SftRole, content: "" };

  let toolCalls: SftToolCall[] | undefined;
  if (value.tool_calls !== undefined && value.tool_calls !== null) {
    if (role !== "assistant") fail(`${at}.tool_calls is only allowed on assistant messages`);
    if (!Array.isArray(value.tool_calls)) fail(`${at}.tool_calls must be an array`);
    toolCalls = (value.tool_calls as unknown[]).map((call, i) =>
      parseToolCall(call, `${at}.tool_calls[${i}]`, fail),
    );
    if (toolCalls.length > 0) message.toolCalls = toolCalls;
  }

  const content = value.content;
  if (typeof content === "string") {
    message.content = content;
  } else if (Array.isArray(content)) {
    message.content = content
      .map((part, i) => {
        if (!isObject(part) || part.type !== "text") {
          return fail(`${at}.content[${i}] must be a {"type": "text", "text": string} part`);
        }
        if (typeof part.text !== "string") return fail(`${at}.content[${i}].text must be a string`);
        return part.text;
      })
      .join("");
  } else if ((content === undefined || content === null) && message.toolCalls) {
    // An assistant turn that only calls tools has no content, as in OpenAI's format.
  } else {
    fail(`${at}.content must be a string or an array of {"type": "text", "text": string} parts`);
  }

  if (value.tool_call_id !== undefined && value.tool_call_id !== null) {
    if (role !== "tool") fail(`${at}.tool_call_id is only allowed on tool messages`);
    if (typeof value.tool_call_id !== "string") fail(`${at}.tool_call_id must be a string`);
    message.toolCallId = value.tool_call_id as string;
  }
  return message;
}

function parseToolCall(value: unknown, at: string, fail: (reason: string) => never): SftToolCall {
  if (!isObject(value)) return fail(`${at} must be an object`);
  if (value.type !== undefined && value.type !== "function") fail(`${at}.type must be "function"`);
  const fn = value.function;
  if (!isObject(fn)) return fail(`${at}.function must be an object with "name" and "arguments"`);
  if (typeof fn.name !== "string" || fn.name === "") {
    return fail(`${at}.function.name must be a non-empty string`);
  }
  // OpenAI sends arguments as a JSON string; an object is accepted and serialized.
  let args: string;
  if (typeof fn.arguments === "string") args = fn.arguments;
  else if (isObject(fn.arguments)) args = JSON.stringify(fn.arguments);
  else return fail(`${at}.function.arguments must be a JSON string`);
  const call: SftToolCall = { name: fn.name, arguments: args };
  if (value.id !== undefined && value.id !== null) {
    if (typeof value.id !== "string") fail(`${at}.id must be a string`);
    call.id = value.id as string;
  }
  return call;
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}
