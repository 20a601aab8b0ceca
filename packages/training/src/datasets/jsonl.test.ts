import { describe, expect, it } from "vitest";
import {
  DatasetLineError,
  dpoPairs,
  forEachSftLine,
  InvalidDatasetError,
  sftExamples,
  validateSftJsonl,
} from "./jsonl.ts";

const ok = (user = "hi", assistant = "hello") =>
  JSON.stringify({
    messages: [
      { role: "user", content: user },
      { role: "assistant", content: assistant },
    ],
  });

function failure(text: string): InvalidDatasetError {
  try {
    validateSftJsonl(text);
  } catch (err) {
    if (err instanceof InvalidDatasetError) return err;
    throw err;
  }
  throw new Error("expected the dataset to be refused");
}

describe("forEachSftLine", () => {
  it("when lines are valid, then every example is visited, as sent, with its line number", () => {
    const seen: [unknown, number][] = [];
    const lines = forEachSftLine(`${ok("a", "b")}\n\n${ok("c", "d")}\n`, (example, line) =>
      seen.push([example, line]),
    );
    expect(lines).toBe(2);
    expect(seen).toEqual([
      [JSON.parse(ok("a", "b")), 1],
      [JSON.parse(ok("c", "d")), 3],
    ]);
  });

  it("when the file has a BOM, CRLF endings and blank lines, then they are accepted", () => {
    const lines: number[] = [];
    expect(
      forEachSftLine(`\ufeff${ok()}\r\n  \r\n${ok()}\r\n`, (_, line) => lines.push(line)),
    ).toBe(2);
    expect(lines).toEqual([1, 3]);
  });

  it("when content is text parts and tools are used, then it is normalized for the engine", () => {
    const line = JSON.stringify({
      messages: [
        {
          role: "developer",
          content: [
            { type: "text", text: "Be " },
            { type: "text", text: "brief." },
          ],
        },
        { role: "user", content: "Weather?" },
        {
          role: "assistant",
          content: null,
          tool_calls: [
            {
              id: "c1",
              type: "function",
              function: { name: "weather", arguments: '{"city":"Oslo"}' },
            },
          ],
        },
        { role: "tool", tool_call_id: "c1", content: "sunny" },
        { role: "assistant", content: "Sunny.", extra: "ignored" },
      ],
      tools: [{ type: "function", function: { name: "weather" } }],
    });
    const [example] = sftExamples(line);
    expect(example).toEqual({
      messages: [
        { role: "developer", content: "Be brief." },
        { role: "user", content: "Weather?" },
        {
          role: "assistant",
          content: "",
          toolCalls: [{ id: "c1", name: "weather", arguments: '{"city":"Oslo"}' }],
        },
        { role: "tool", content: "sunny", toolCallId: "c1" },
        { role: "assistant", content: "Sunny." },
      ],
      tools: [{ type: "function", function: { name: "weather" } }],
    });
  });

  it.each([
    ["not JSON", `${ok()}\n${ok()}\n{"messages": [`, 3, "not valid JSON"],
    ["an array", "[1, 2]", 1, 'must be a JSON object with "messages"'],
    ["no messages", '{"prompt": "x"}', 1, '"messages" is required'],
    ["empty messages", '{"messages": []}', 1, "messages must be a non-empty array"],
    ["a message that is a string", '{"messages": ["hi"]}', 1, "messages[0] must be an object"],
    [
      "an unknown role",
      `${ok()}\n\n\n\n\n\n${JSON.stringify({
        messages: [
          { role: "user", content: "a" },
          { role: "assistant", content: "b" },
          { role: "bot", content: "c" },
        ],
      })}`,
      7,
      "messages[2].role must be one of system, developer, user, assistant, tool",
    ],
    [
      "numeric content",
      JSON.stringify({ messages: [{ role: "assistant", content: 4 }] }),
      1,
      "messages[0].content must be a string or an array of text parts (only an assistant turn with tool_calls may go without content)",
    ],
    [
      "an image part",
      JSON.stringify({ messages: [{ role: "assistant", content: [{ type: "image_url" }] }] }),
      1,
      "messages[0].content[0].text is required",
    ],
    [
      "a text part without text",
      JSON.stringify({ messages: [{ role: "assistant", content: [{ type: "text" }] }] }),
      1,
      "messages[0].content[0].text is required",
    ],
    [
      "no assistant turn",
      `${ok()}\n${ok()}\n\n\n\n\n\n\n${JSON.stringify({ messages: [{ role: "user", content: "a" }] })}`,
      9,
      "messages has no assistant message to learn from",
    ],
    [
      "tools that are not an array",
      JSON.stringify({ messages: [{ role: "assistant", content: "a" }], tools: {} }),
      1,
      "tools must be an array or null",
    ],
    [
      "a tool call on a user message",
      JSON.stringify({
        messages: [
          { role: "user", content: "a", tool_calls: [] },
          { role: "assistant", content: "b" },
        ],
      }),
      1,
      "messages[0].role must be assistant: only assistant messages may carry tool_calls",
    ],
    [
      "a tool call without a name",
      JSON.stringify({
        messages: [
          { role: "assistant", tool_calls: [{ type: "function", function: { arguments: "{}" } }] },
        ],
      }),
      1,
      "messages[0].tool_calls[0].function.name is required",
    ],
  ])("when a line is %s, then DatasetLineError names the line", (_, text, line, reason) => {
    const err = failure(text);
    expect(err).toBeInstanceOf(DatasetLineError);
    expect(err.line).toBe(line);
    expect(err.reason).toBe(reason);
    expect(err.message).toBe(`Line ${line}: ${reason}.`);
  });

  it.each(["", "\n\n", "  \r\n"])(
    "when the file has no example (%j), then it is refused as empty",
    (text) => {
      const err = failure(text);
      expect(err).not.toBeInstanceOf(DatasetLineError);
      expect(err.line).toBeNull();
      expect(err.message).toBe("The dataset is empty: no JSONL lines.");
    },
  );
});

describe("validateSftJsonl", () => {
  it("when the file is valid, then only the count is returned", () => {
    expect(validateSftJsonl(`${ok()}\n${ok()}\n${ok()}`)).toEqual({ lines: 3 });
  });
});

/** A DPO line (OpenAI's preference format). */
const pair = (question = "2 + 2?", preferred = "4", rejected = "5") =>
  JSON.stringify({
    input: { messages: [{ role: "user", content: question }] },
    preferred_output: [{ role: "assistant", content: preferred }],
    non_preferred_output: [{ role: "assistant", content: rejected }],
  });

function lineError(run: () => unknown): DatasetLineError {
  try {
    run();
  } catch (err) {
    if (err instanceof DatasetLineError) return err;
    throw err;
  }
  throw new Error("expected a DatasetLineError");
}

describe("DPO lines", () => {
  it("when a dataset is of preference pairs, then it is accepted and read as the engine's pairs", () => {
    const text = `${pair()}\n\n${JSON.stringify({
      input: {
        messages: [
          { role: "system", content: "Be short." },
          { role: "user", content: [{ type: "text", text: "Weather?" }] },
        ],
        tools: [{ type: "function", function: { name: "weather" } }],
      },
      preferred_output: [{ role: "assistant", content: "Sunny." }],
      non_preferred_output: [
        {
          role: "assistant",
          content: null,
          tool_calls: [{ type: "function", function: { name: "weather", arguments: {} } }],
        },
      ],
      extra: "ignored",
    })}`;
    expect(validateSftJsonl(text)).toEqual({ lines: 2 });
    expect(dpoPairs(text)).toEqual([
      {
        messages: [{ role: "user", content: "2 + 2?" }],
        chosen: { role: "assistant", content: "4" },
        rejected: { role: "assistant", content: "5" },
      },
      {
        messages: [
          { role: "system", content: "Be short." },
          { role: "user", content: "Weather?" },
        ],
        tools: [{ type: "function", function: { name: "weather" } }],
        chosen: { role: "assistant", content: "Sunny." },
        rejected: {
          role: "assistant",
          content: "",
          toolCalls: [{ name: "weather", arguments: "{}" }],
        },
      },
    ]);
  });

  it.each([
    [
      "no non-preferred output",
      JSON.stringify({
        input: { messages: [{ role: "user", content: "a" }] },
        preferred_output: [],
      }),
      '"non_preferred_output" is required',
    ],
    [
      "two preferred messages",
      JSON.stringify({
        input: { messages: [{ role: "user", content: "a" }] },
        preferred_output: [
          { role: "assistant", content: "b" },
          { role: "assistant", content: "c" },
        ],
        non_preferred_output: [{ role: "assistant", content: "d" }],
      }),
      "preferred_output must hold one assistant message",
    ],
    [
      "a preferred output that is a user's",
      JSON.stringify({
        input: { messages: [{ role: "user", content: "a" }] },
        preferred_output: [{ role: "user", content: "b" }],
        non_preferred_output: [{ role: "assistant", content: "d" }],
      }),
      "preferred_output[0].role must be assistant",
    ],
    [
      "an input without messages",
      JSON.stringify({
        input: {},
        preferred_output: [{ role: "assistant", content: "b" }],
        non_preferred_output: [{ role: "assistant", content: "d" }],
      }),
      "input.messages is required",
    ],
  ])("when a pair has %s, then the line is refused, naming why", (_, line, reason) => {
    const err = lineError(() => validateSftJsonl(`${pair()}\n${line}`));
    expect(err.line).toBe(2);
    expect(err.reason).toBe(reason);
    expect(lineError(() => dpoPairs(`${pair()}\n${line}`)).message).toBe(`Line 2: ${reason}.`);
  });

  it("when a dataset mixes the two kinds, then the first line other than the first's is refused", () => {
    expect(lineError(() => validateSftJsonl(`${ok()}\n\n${pair()}`)).message).toBe(
      "Line 3: this line is a DPO pair ({input, preferred_output, non_preferred_output}) and the dataset's first line an SFT example ({messages}): a dataset holds one kind.",
    );
    expect(lineError(() => validateSftJsonl(`${pair()}\n${ok()}`)).line).toBe(2);
  });

  it("when a job's lines are of the other method's kind, then the job's check names the line and the method", () => {
    expect(lineError(() => sftExamples(`${ok()}\n${pair()}`)).message).toBe(
      'Line 2: this line is a DPO pair ({input, preferred_output, non_preferred_output}), and an SFT job trains on {messages} lines: set config.method to "dpo" to train on preference pairs.',
    );
    expect(lineError(() => dpoPairs(ok())).message).toBe(
      'Line 1: this line is an SFT example ({messages}), and a DPO job (config.method "dpo") trains on preference pairs, {input, preferred_output, non_preferred_output}.',
    );
  });
});
