import { spawn, spawnSync } from "node:child_process";
import { mkdirSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import type { ArborClient } from "@arbor/client";
import { loadModel } from "@arbor/engine/model";
import { readAdapterTar } from "@arbor/training";
import { expect } from "vitest";

/**
 * The engine's PyTorch reference (packages/engine/test/torch_reference.py, Debian's
 * python3-torch) for contract tests: a base model folder with a PEFT adapter folder applied by
 * PEFT's tensor names. Where torch is missing a test says why it skips; under CI it fails.
 */
const found = spawnSync("/usr/bin/python3", ["-c", "import torch"]).status === 0;
const required = process.env.CI === "true";

/** Whether to run a torch test: skipped (saying why) without torch, failing under CI. */
export function torchTest(name: string): boolean {
  if (found || required) return true;
  console.log(
    `${name}: PyTorch not found (/usr/bin/python3 -c "import torch"): skipped; apt-get install python3-torch libopenblas0-pthread`,
  );
  return false;
}

const script = join(
  dirname(fileURLToPath(import.meta.resolve("@arbor/engine/model"))),
  "../../test/torch_reference.py",
);

/**
 * Last-position logits of each prompt, by the reference, with the adapter applied. Run without
 * blocking: the server under test shares this process, and a loop blocked for longer than its
 * keep-alive timeout closed the client's idle socket just as the next request took it
 * (ECONNRESET).
 */
export async function referenceLogits(
  modelDir: string,
  adapterDir: string,
  prompts: number[][],
): Promise<number[][]> {
  const child = spawn("/usr/bin/python3", [script, modelDir], {
    env: { ...process.env, TORCH_THREADS: "1", OMP_NUM_THREADS: "1" },
  });
  let stdout = "";
  let stderr = "";
  child.stdout.setEncoding("utf8").on("data", (d: string) => {
    stdout += d;
  });
  child.stderr.setEncoding("utf8").on("data", (d: string) => {
    stderr += d;
  });
  child.stdin.end(JSON.stringify({ prompts, adapter: { dir: adapterDir } }));
  const status = await new Promise<number | null>((resolve, reject) => {
    child.once("error", reject);
    child.once("close", resolve);
  });
  if (status !== 0) throw new Error(`torch_reference.py failed: ${stderr}`);
  return (JSON.parse(stdout) as { last_logits: number[][] }).last_logits;
}

/** The k largest log-probabilities of a logits row, in descending order. */
export function topLogprobs(logits: number[], k: number): number[] {
  let max = Number.NEGATIVE_INFINITY;
  for (const v of logits) max = Math.max(max, v);
  let sum = 0;
  for (const v of logits) sum += Math.exp(v - max);
  const logZ = max + Math.log(sum);
  return [...logits]
    .sort((a, b) => b - a)
    .slice(0, k)
    .map((v) => v - logZ);
}

/** Unpacks a downloaded adapter tar into `dir` (PEFT's folder layout). */
export async function unpackAdapter(tar: Uint8Array, dir: string): Promise<string> {
  mkdirSync(dir, { recursive: true });
  for (const [name, bytes] of Object.entries(await readAdapterTar(tar)))
    writeFileSync(join(dir, name), bytes);
  return dir;
}

/**
 * The server's top log-probs for the first answer token, serving `model`, equal the reference's
 * on the base folder with the adapter folder applied, within 1e-3.
 */
export async function expectServedLikeReference(
  client: ArborClient,
  baseDir: string,
  adapterDir: string,
  model: string,
): Promise<void> {
  const messages = [{ role: "user" as const, content: "What is the code word 3?" }];
  const prompt = (await loadModel(baseDir)).chat.encode(messages, { addGenerationPrompt: true });
  const [logits] = await referenceLogits(baseDir, adapterDir, [prompt]);
  const completion = await client.chat.completions.create({
    model,
    messages,
    max_tokens: 1,
    temperature: 0,
    logprobs: true,
    top_logprobs: 5,
  });
  const served = completion.choices[0]!.logprobs!.content![0]!.top_logprobs.map((t) => t.logprob);
  const expected = topLogprobs(logits!, 5);
  expect(served).toHaveLength(5);
  for (let i = 0; i < 5; i++) {
    expect(Math.abs(served[i]! - expected[i]!), `rank ${i}`).toBeLessThanOrEqual(1e-3);
  }
}
