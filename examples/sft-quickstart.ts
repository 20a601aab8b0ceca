/**
 * SFT quickstart: teach arbor/tiny-chat to answer arithmetic in a fixed JSON format it never
 * saw in pretraining. Upload a dataset, train, and compare answers before and after.
 *
 *   ./scripts/serve &   then   node examples/sft-quickstart.ts
 */
import type { ArborClient } from "@arbor/client";
import { connect } from "./connect.ts";

export interface SftQuickstartResult {
  before: number;
  after: number;
  jobId: string;
  model: string;
}

/** `What is A + B? Answer in JSON.` → `{"answer": A+B}`, from a seeded generator. */
function* examples(seed: number, count: number): Generator<{ question: string; answer: string }> {
  let state = seed;
  const next = () => {
    state = (state * 1103515245 + 12345) % 2 ** 31;
    return state / 2 ** 31;
  };
  for (let i = 0; i < count; i++) {
    const a = Math.floor(next() * 10);
    const b = Math.floor(next() * 10);
    yield { question: `What is ${a} + ${b}? Answer in JSON.`, answer: `{"answer": ${a + b}}` };
  }
}

async function accuracy(
  client: ArborClient,
  model: string,
  tests: { question: string; answer: string }[],
): Promise<number> {
  const answers = await Promise.all(
    tests.map(async ({ question }) => {
      const completion = await client.chat.completions.create({
        model,
        messages: [{ role: "user", content: question }],
        max_tokens: 16,
        temperature: 0,
      });
      return completion.choices[0]!.message.content?.trim() ?? "";
    }),
  );
  return answers.filter((a, i) => a === tests[i]!.answer).length / tests.length;
}

export async function runSftQuickstart(
  client: ArborClient,
  log: (line: string) => void = console.log,
): Promise<SftQuickstartResult> {
  const model = await client.training.models.create({
    project: "examples",
    name: `json-answers-${Date.now()}`,
    base_model: "arbor/tiny-chat",
  });
  const alias = `${model.entity}/${model.project}/${model.name}`;
  const train = [...examples(1, 200)];
  const held = [...examples(999, 40)];
  const jsonl = train
    .map(({ question, answer }) =>
      JSON.stringify({
        messages: [
          { role: "user", content: question },
          { role: "assistant", content: answer },
        ],
      }),
    )
    .join("\n");
  const dataset = await client.training.datasets.create(jsonl, { name: "json-answers" });
  log(`uploaded ${dataset.lines} examples as ${dataset.url}`);

  const before = await accuracy(client, alias, held);
  log(`before: ${(before * 100).toFixed(0)}% exact on ${held.length} held-out questions`);

  const job = await client.training.jobs.createSft({
    model_id: model.id,
    training_data_url: dataset.url,
    config: { epochs: 10, batch_size: 8, learning_rate: 3e-3, lr_schedule: "cosine" },
    experimental_config: { lora_rank: 8, lora_alpha: 16, seed: 1 },
  });
  for await (const event of client.training.jobs.events.follow(job.id)) {
    const data = event.data as Record<string, number>;
    if (event.type === "gradient_step" && data.gradient_step! % 25 === 0)
      log(`step ${data.gradient_step}: loss ${data.loss!.toFixed(4)}`);
    if (event.type === "training_failed")
      throw new Error(`training failed: ${String(event.data.error_message)}`);
  }

  const after = await accuracy(client, alias, held);
  log(`after:  ${(after * 100).toFixed(0)}% exact`);
  const sample = held[0]!;
  const answer = await client.chat.completions.create({
    model: alias,
    messages: [{ role: "user", content: sample.question }],
    max_tokens: 16,
    temperature: 0,
  });
  log(`${sample.question} → ${answer.choices[0]!.message.content} (${answer.model})`);
  return { before, after, jobId: job.id, model: alias };
}

if (import.meta.main) await runSftQuickstart(connect());
