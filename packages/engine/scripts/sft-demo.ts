/**
 * Shows that the held-out tasks are learnable: full fine-tuning of a model folder on word
 * reversal or JSON answers, with exact-match accuracy on unseen prompts before and after.
 * Usage: nice node scripts/sft-demo.ts [modelDir] [reverse|json] [seconds=60]
 */
import { fileURLToPath } from "node:url";
import { defaultKernels } from "../src/kernels/wasm.ts";
import { loadModel } from "../src/model/model.ts";
import { Rng } from "../src/model/rng.ts";
import { Engine } from "../src/serve/engine.ts";
import { Trainer } from "../src/train/optim.ts";
import { packBatch } from "../src/train/sft.ts";
import { jsonAnswerExample, reversalExample } from "./synthetic-chat.ts";

const dir = process.argv[2] ?? fileURLToPath(new URL("../models/tiny-chat/", import.meta.url));
const task = process.argv[3] === "json" ? jsonAnswerExample : reversalExample;
const seconds = Number(process.argv[4] ?? 60);
const model = await loadModel(dir);
const engine = new Engine(model);

const evalRng = new Rng(999);
const evalSet = Array.from({ length: 40 }, () => task(evalRng));
async function accuracy(): Promise<number> {
  let correct = 0;
  for (const [question, answer] of evalSet) {
    const result = await engine.complete({
      messages: [{ role: "user", content: question }],
      temperature: 0,
      maxTokens: 24,
    });
    if (result.choices[0]!.text === answer) correct++;
  }
  return correct / evalSet.length;
}

const before = await accuracy();
const trainRng = new Rng(7);
const trainer = new Trainer(model, defaultKernels(), {
  schedule: { kind: "cosine", peak: 2e-3, warmupSteps: 5, totalSteps: 200, minRatio: 0.1 },
  adamW: { weightDecay: 0 },
});
const start = performance.now();
let steps = 0;
let loss = 0;
while ((performance.now() - start) / 1000 < seconds && steps < 200) {
  const chats = Array.from({ length: 16 }, () => {
    const [q, a] = task(trainRng);
    return [
      { role: "user" as const, content: q },
      { role: "assistant" as const, content: a },
    ];
  });
  const sequences = chats.map((chat) => {
    const { tokens, mask } = model.chat.trainingTokens(chat, () => true);
    return { tokens, weights: mask };
  });
  loss = trainer.step(packBatch(sequences, 49)).loss;
  steps++;
}
const after = await accuracy();
console.log(
  `${process.argv[3] ?? "reverse"}: accuracy ${before.toFixed(2)} -> ${after.toFixed(2)} after ${steps} steps (${((performance.now() - start) / 1000).toFixed(0)} s), last loss ${loss.toFixed(3)}`,
);
for (const [q] of evalSet.slice(0, 3)) {
  const r = await engine.complete({
    messages: [{ role: "user", content: q }],
    temperature: 0,
    maxTokens: 24,
  });
  console.log(`  ${JSON.stringify(q)} -> ${JSON.stringify(r.choices[0]!.text)}`);
}
