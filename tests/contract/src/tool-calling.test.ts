import { cpSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import type { ArborClient } from "@arbor/client";
import { catalogModelDir } from "@arbor/engine/model";
import OpenAI from "openai";
import type { RunnableToolFunctionWithParse } from "openai/lib/RunnableFunction";
import type { ChatCompletionMessageParam } from "openai/resources/chat/completions";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { followAll } from "./jobs.ts";

/**
 * Tool calling end to end with the stock `openai` client: tiny-chat (whose template writes
 * Qwen2.5's `<tool_call>` blocks) fine-tuned here to call a calculator, then driven by the
 * client's own tool runner and parsing helpers.
 */
const BASE = "acme/tiny-chat-tools";
let server: RunningServer;
let client: ArborClient;
let openai: OpenAI;
let model: string;

const integers = { type: "object", properties: { a: { type: "integer" }, b: { type: "integer" } } };
const parameters = { ...integers, required: ["a", "b"], additionalProperties: false };
const tools = [
  { type: "function" as const, function: { name: "add", strict: true, parameters } },
  { type: "function" as const, function: { name: "mul", strict: true, parameters } },
];
const ops = {
  add: { sign: "+", run: (a: number, b: number) => a + b },
  mul: { sign: "*", run: (a: number, b: number) => a * b },
};

/** One training conversation: the question, the call, its answer, and the reply. */
function example(op: keyof typeof ops, a: number, b: number, id: number) {
  const result = String(ops[op].run(a, b));
  return {
    tools,
    messages: [
      { role: "user", content: `${a} ${ops[op].sign} ${b}` },
      {
        role: "assistant",
        content: null,
        tool_calls: [
          {
            id: `call_${id}`,
            type: "function",
            function: { name: op, arguments: JSON.stringify({ a, b }) },
          },
        ],
      },
      { role: "tool", tool_call_id: `call_${id}`, content: result },
      { role: "assistant", content: result },
    ],
  };
}

beforeAll(async () => {
  server = await startServer({}, { worker: true });
  client = server.authorizedClient();
  openai = new OpenAI({ baseURL: `${server.baseUrl}/v1`, apiKey: server.adminKey, maxRetries: 0 });
  // tiny-chat's character-level vocabulary takes ~450 tokens for this conversation and its two
  // tools: its context is raised as for any long-context base.
  const dir = join(server.dataDir, "models", BASE);
  cpSync(catalogModelDir("arbor/tiny-chat"), dir, { recursive: true });
  const config = JSON.parse(readFileSync(join(dir, "config.json"), "utf8"));
  writeFileSync(
    join(dir, "config.json"),
    JSON.stringify({ ...config, max_position_embeddings: 1024 }),
  );
  await server.engines.refresh();
  const created = await client.training.models.create({
    project: "tools",
    name: "calc",
    base_model: BASE,
  });
  model = `${created.entity}/tools/calc`;
  const modelId = created.id;
  const lines = [];
  let id = 0;
  for (let a = 1; a <= 6; a++) {
    for (const b of [2, 3, 5]) {
      lines.push(example(a % 2 === 0 ? "add" : "mul", a, b, id++));
      lines.push(example(a % 2 === 0 ? "mul" : "add", b, a, id++));
    }
  }
  const dataset = await client.training.datasets.create(
    lines.map((l) => JSON.stringify(l)).join("\n"),
  );
  const job = await client.training.jobs.createSft({
    model_id: modelId,
    training_data_url: dataset.url,
    config: { epochs: 12, batch_size: 4, learning_rate: 1e-2, lr_schedule: "constant" },
  });
  const events = await followAll(client, job.id);
  expect(events.at(-1)!.type).toBe("training_ended");
});
afterAll(() => server?.close());

/** The tools as the runner calls them: each run is recorded. */
type Args = { a: number; b: number };

function runnable(called: { name: string; args: unknown }[]) {
  const runnable = tools.map((t) => ({
    type: "function" as const,
    function: {
      ...t.function,
      parse: (text: string) => JSON.parse(text) as Args,
      function: (args: Args) => {
        called.push({ name: t.function.name, args });
        return String(ops[t.function.name as keyof typeof ops].run(args.a, args.b));
      },
    },
  }));
  // The client's type asks for a description; these functions have none, as they were trained.
  return runnable as unknown as RunnableToolFunctionWithParse<Args>[];
}

const integerArgs = { a: expect.any(Number), b: expect.any(Number) };

describe("tool calling with the openai client", () => {
  it("when runTools drives a conversation with two tools, then the model calls the named one, the runner answers it, and the model replies in text", async () => {
    const called: { name: string; args: unknown }[] = [];
    // The first turn names its function, so the call is constrained to its schema.
    const first = openai.chat.completions.runTools({
      model,
      messages: [{ role: "user", content: "4 + 3" }],
      tools: runnable(called),
      tool_choice: { type: "function", function: { name: "add" } },
      temperature: 0,
    });
    const firstCompletion = await first.finalChatCompletion();
    expect(firstCompletion.choices[0]!.finish_reason).toBe("tool_calls");
    expect(called).toEqual([{ name: "add", args: integerArgs }]);
    const [args] = called.map((c) => c.args as { a: number; b: number });
    expect(Number.isInteger(args!.a) && Number.isInteger(args!.b)).toBe(true);
    const call = firstCompletion.choices[0]!.message.tool_calls![0]!;
    expect(call).toMatchObject({ id: expect.stringMatching(/^call_/), type: "function" });
    expect(first.messages.at(-1)).toEqual({
      role: "tool",
      tool_call_id: call.id,
      content: String(args!.a + args!.b),
    });

    // The conversation goes on with the call and its answer in it; the model answers in text.
    const second = openai.chat.completions.runTools({
      model,
      messages: first.messages as ChatCompletionMessageParam[],
      tools: runnable(called),
      temperature: 0,
      max_tokens: 40,
    });
    const reply = await second.finalContent();
    expect(typeof reply).toBe("string");
    expect(reply!.length).toBeGreaterThan(0);
    expect(called).toHaveLength(1);
    expect((await second.finalChatCompletion()).choices[0]!.finish_reason).toBe("stop");
  });

  it("when runTools streams, then the client assembles the streamed call from its deltas", async () => {
    const called: { name: string; args: unknown }[] = [];
    const runner = openai.chat.completions.runTools({
      model,
      messages: [{ role: "user", content: "2 * 5" }],
      tools: runnable(called),
      tool_choice: { type: "function", function: { name: "mul" } },
      temperature: 0,
      stream: true,
    });
    const done: { name: string; arguments: string }[] = [];
    runner.on("tool_calls.function.arguments.done", (event) => done.push(event));
    const completion = await runner.finalChatCompletion();
    expect(completion.choices[0]!.finish_reason).toBe("tool_calls");
    expect(called).toEqual([{ name: "mul", args: integerArgs }]);
    expect(done).toEqual([
      expect.objectContaining({ name: "mul", parsed_arguments: called[0]!.args }),
    ]);
  });

  it("when a tool call is required, then parse() gives the arguments parsed, non-streamed and streamed alike", async () => {
    const request = {
      model,
      messages: [{ role: "user" as const, content: "3 + 5" }],
      tools,
      tool_choice: "required" as const,
      temperature: 0,
    };
    const parsed = await openai.chat.completions.parse(request);
    const call = parsed.choices[0]!.message.tool_calls?.[0];
    expect(parsed.choices[0]!.finish_reason).toBe("tool_calls");
    expect(call?.type === "function" && ["add", "mul"].includes(call.function.name)).toBe(true);
    expect(call?.type === "function" && call.function.parsed_arguments).toEqual(integerArgs);

    const stream = openai.chat.completions.stream(request);
    const chunks: OpenAI.ChatCompletionChunk[] = [];
    stream.on("chunk", (chunk) => chunks.push(chunk));
    const final = await stream.finalChatCompletion();
    const streamed = final.choices[0]!.message.tool_calls?.[0];
    expect(streamed?.type === "function" && streamed.function.parsed_arguments).toEqual(
      call?.type === "function" && call.function.parsed_arguments,
    );
    // After the call's opening piece (its id, type and name), only its arguments follow.
    const pieces = chunks.flatMap((c) =>
      c.choices.flatMap((choice) => choice.delta.tool_calls ?? []),
    );
    expect(pieces.slice(1).every((p) => p.index === 0 && !p.id && !p.function?.name)).toBe(true);
    expect(
      pieces
        .slice(1)
        .map((p) => p.function!.arguments)
        .join(""),
    ).toBe(streamed?.type === "function" ? streamed.function.arguments : "");
    expect(chunks.at(-1)!.choices[0]!.finish_reason).toBe("tool_calls");
  });

  it("when an RL job trains on rollouts that call tools, then it steps on the assistant's turns, calls included", async () => {
    // Two rollouts of a question, sampled with their logprobs: the call, its answer, the reply.
    const rollout = async (seed: number) => {
      const messages: ChatCompletionMessageParam[] = [{ role: "user", content: "5 + 2" }];
      const first = await openai.chat.completions.create({
        model,
        messages,
        tools,
        tool_choice: { type: "function", function: { name: "add" } },
        logprobs: true,
        seed,
      });
      const call = first.choices[0]!.message.tool_calls![0]!;
      const args = JSON.parse(call.type === "function" ? call.function.arguments : "{}") as Args;
      const answer = {
        role: "tool" as const,
        tool_call_id: call.id,
        content: String(args.a + args.b),
      };
      const second = await openai.chat.completions.create({
        model,
        messages: [...messages, first.choices[0]!.message, answer],
        tools,
        logprobs: true,
        max_tokens: 8,
        seed,
      });
      return {
        turns: [...messages, first.choices[0]!, answer, second.choices[0]!],
        reply: second.choices[0]!.message.content ?? "",
      };
    };
    const rollouts = [await rollout(1), await rollout(2)];
    const trajectories = rollouts.map(({ turns }, i) => ({
      messages_and_choices: turns,
      reward: i,
      tools,
    }));
    const created = await client.training.models.create({
      project: "tools",
      name: "calc-rl",
      base_model: BASE,
    });
    const job = await client.training.jobs.createRl({
      model_id: created.id,
      trajectory_groups: [{ trajectories }] as never,
      experimental_config: { learning_rate: 1e-3 },
    });
    const events = await followAll(client, job.id);
    expect(events.at(-1)!.type).toBe("training_ended");
    const step = events.find((e) => e.type === "gradient_step")!.data as Record<string, number>;
    // The text replies alone train at most a token per (ASCII) character and their end of
    // turn: more than that is the calls' turns.
    const replies = rollouts.reduce((n, { reply }) => n + reply.length + 1, 0);
    expect(step.num_trainable_tokens).toBeGreaterThan(replies);
    expect(step.grad_norm).toBeGreaterThan(0);
  });

  it("when tool_choice names a function that tools do not declare, then 400 naming tool_choice", async () => {
    const error = await openai.chat.completions
      .create({
        model,
        messages: [{ role: "user", content: "1 + 1" }],
        tools,
        tool_choice: { type: "function", function: { name: "div" } },
      })
      .catch((err: unknown) => err);
    expect(error).toBeInstanceOf(OpenAI.BadRequestError);
    expect((error as InstanceType<typeof OpenAI.BadRequestError>).error).toMatchObject({
      type: "invalid_request_error",
      param: "tool_choice",
    });
  });
});
