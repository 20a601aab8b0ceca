import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { afterAll, describe, expect, it } from "vitest";
import { FAMILIES, type Family, familyChatFiles } from "../../test/families.ts";
import type { Kernels } from "../kernels/types.ts";
import { createWasmKernels } from "../kernels/wasm.ts";
import { LoraTrainer } from "../train/lora-train.ts";
import { packBatch } from "../train/sft.ts";
import { ChatFormat } from "./chat.ts";
import { parseConfig } from "./config.ts";
import { createKvCache, forwardBatch } from "./forward.ts";
import { createLoraAdapter, loraParameters, saveAdapter } from "./lora.ts";
import type { WeightStorage } from "./memory.ts";
import { createModel, loadModel, type Model, saveModel } from "./model.ts";
import { Rng } from "./rng.ts";
import { initWeights, parameters } from "./weights.ts";

/**
 * Each family the engine serves, checked against a PyTorch reference of the architecture
 * (test/torch_reference.py, Debian's python3-torch): a random-weight model in the family's real
 * config shape (its head_dim, GQA ratio, norms, biases and rope settings; 2 layers and a small
 * hidden size), saved as a Hugging Face folder in BF16 with real tokenizer files, and loaded back.
 */
const torchFound = spawnSync("/usr/bin/python3", ["-c", "import torch"]).status === 0;
const required = process.env.CI === "true";
if (!torchFound) {
  console.log(
    `families.test: PyTorch not found (/usr/bin/python3 -c "import torch"): ${required ? "failing, as CI needs it" : "skipped"}; apt-get install python3-torch libopenblas0-pthread`,
  );
}

const llama3 = FAMILIES.find((f) => f.name === "Llama 3.1")!;
const qwen3 = FAMILIES.find((f) => f.name === "Qwen3")!;

/** The real shapes, scaled down: layers 2, hidden 128; head_dim and the GQA ratio as published. */
const CASES: { name: string; tokenizer: Family; config: Record<string, unknown> }[] = [
  {
    name: "Llama 3.2 (llama3 rope scaling, tied)",
    tokenizer: llama3,
    config: {
      model_type: "llama",
      num_attention_heads: 4,
      num_key_value_heads: 1,
      head_dim: 64,
      rope_theta: 500000,
      rope_scaling: {
        rope_type: "llama3",
        factor: 32,
        low_freq_factor: 1,
        high_freq_factor: 4,
        original_max_position_embeddings: 64,
      },
      tie_word_embeddings: true,
    },
  },
  {
    name: "Llama 3.1 (untied lm_head)",
    tokenizer: llama3,
    config: {
      model_type: "llama",
      num_attention_heads: 4,
      num_key_value_heads: 1,
      head_dim: 64,
      rope_theta: 500000,
      tie_word_embeddings: false,
    },
  },
  {
    name: "SmolLM2 (llama, GQA 3)",
    tokenizer: llama3,
    config: {
      model_type: "llama",
      num_attention_heads: 3,
      num_key_value_heads: 1,
      head_dim: 64,
      rope_theta: 100000,
      tie_word_embeddings: true,
    },
  },
  {
    name: "SmolLM3 (NoPE layers)",
    tokenizer: llama3,
    config: {
      model_type: "smollm3",
      num_attention_heads: 4,
      num_key_value_heads: 1,
      head_dim: 128,
      rope_theta: 5000000,
      no_rope_layers: [1, 0],
      tie_word_embeddings: true,
    },
  },
  {
    name: "Qwen2.5 (q/k/v biases, GQA 7)",
    tokenizer: qwen3,
    config: {
      model_type: "qwen2",
      num_attention_heads: 7,
      num_key_value_heads: 1,
      head_dim: 64,
      rope_theta: 1000000,
      tie_word_embeddings: true,
    },
  },
  {
    name: "Qwen3 (per-head q/k norms, head_dim 128)",
    tokenizer: qwen3,
    config: {
      model_type: "qwen3",
      num_attention_heads: 4,
      num_key_value_heads: 2,
      head_dim: 128,
      rope_theta: 1000000,
      tie_word_embeddings: true,
    },
  },
];

const dirs: string[] = [];
afterAll(() => {
  for (const dir of dirs) rmSync(dir, { recursive: true, force: true });
});

/** A random model of the case's shape, with weights large enough that logits spread. */
function buildModel(config: Record<string, unknown>, tokenizer: Family, seed: number): Model {
  const files = familyChatFiles(tokenizer);
  const chat = new ChatFormat(files, []);
  const parsed = parseConfig({
    hidden_size: 128,
    intermediate_size: 256,
    num_hidden_layers: 2,
    vocab_size: chat.tokenizer.vocabSize,
    max_position_embeddings: 512,
    rms_norm_eps: 1e-6,
    ...config,
  });
  const weights = initWeights(parsed, seed);
  const rng = new Rng(seed + 1);
  for (const p of parameters(parsed, weights)) {
    const isNorm = p.name.endsWith("norm.weight");
    for (let i = 0; i < p.data.length; i++) {
      // Norms near 1 (but not 1, so a missing norm shows), biases and weights spread out.
      p.data[i] = isNorm
        ? 1 + 0.2 * rng.normal()
        : p.data[i]! * 6 + (p.name.endsWith(".bias") ? 0.5 * rng.normal() : 0);
    }
  }
  return createModel(parsed, weights, files);
}

interface Reference {
  last_logits: number[][];
  greedy?: number[];
  loss?: number;
  grads?: Record<string, number[]>;
}

function reference(dir: string, request: object): Reference {
  const script = fileURLToPath(new URL("../../test/torch_reference.py", import.meta.url));
  const result = spawnSync("/usr/bin/python3", [script, dir], {
    input: JSON.stringify(request),
    encoding: "utf8",
    maxBuffer: 512 * 1024 * 1024,
    env: { ...process.env, TORCH_THREADS: "1", OMP_NUM_THREADS: "1" },
  });
  if (result.status !== 0) throw new Error(`torch_reference.py failed: ${result.stderr}`);
  return JSON.parse(result.stdout) as Reference;
}

function maxAbsDiff(a: ArrayLike<number>, b: ArrayLike<number>): number {
  let max = 0;
  for (let i = 0; i < a.length; i++) max = Math.max(max, Math.abs(a[i]! - b[i]!));
  return max;
}

function argmax(values: ArrayLike<number>): number {
  let best = 0;
  for (let i = 1; i < values.length; i++) if (values[i]! > values[best]!) best = i;
  return best;
}

describe.each(CASES)("$name", ({ config, tokenizer }) => {
  it.skipIf(!torchFound && !required)(
    "when saved in BF16 and loaded as plain arrays, packed in F32 or packed in BF16, then logits, greedy tokens and LoRA gradients match PyTorch",
    async () => {
      const dir = mkdtempSync(join(tmpdir(), "arbor-family-"));
      dirs.push(dir);
      await saveModel(buildModel(config, tokenizer, 7), dir, { dtype: "BF16" });
      const model = await loadModel(dir);
      const prompts = [
        model.chat.encode(
          [
            { role: "system", content: "You are terse." },
            { role: "user", content: "Name three colours, and a fruit of each." },
          ],
          { addGenerationPrompt: true },
        ),
        model.chat.encode([{ role: "user", content: "Hi! 你好 🙂" }], {
          addGenerationPrompt: true,
        }),
      ];

      // LoRA on every linear, with B non-zero so it changes the output.
      const adapter = createLoraAdapter(model, { rank: 4, alpha: 8, baseModel: "test" }, 3);
      const rng = new Rng(11);
      for (const p of loraParameters(adapter))
        for (let i = 0; i < p.data.length; i++) p.data[i] = 0.05 * rng.normal();
      const adapterDir = join(dir, "adapter");
      await saveAdapter(adapter, adapterDir);
      const training = model.chat.trainingTokens(
        [
          { role: "user", content: "What is 2 + 2?" },
          { role: "assistant", content: "4, of course." },
        ],
        () => true,
      );
      const batch = packBatch([{ tokens: training.tokens, weights: training.mask }], 512);

      const torch = reference(dir, {
        prompts,
        greedy: 20,
        lora: { dir: adapterDir },
        batch: [
          {
            inputs: Array.from(batch.inputs),
            targets: Array.from(batch.targets),
            mask: Array.from(batch.lossMask),
          },
        ],
      });

      // The weights are BF16 numbers in every mode (the file's), so one tolerance holds for all;
      // packed in BF16 they are widened exactly, so its logits are packed F32's, bit for bit.
      const lastLogits = new Map<WeightStorage, Float32Array[]>();
      for (const storage of ["plain", "f32", "bf16"] as const) {
        const kernels = createWasmKernels("auto", { threads: 1 });
        const m = storage === "plain" ? model : await loadModel(dir, { kernels, weights: storage });
        lastLogits.set(storage, checkEngine(m, kernels, storage));
      }
      expect(lastLogits.get("bf16")).toEqual(lastLogits.get("f32"));

      /** Logits, greedy decoding and LoRA gradients of `m` against PyTorch's. */
      function checkEngine(m: Model, kernels: Kernels, storage: WeightStorage): Float32Array[] {
        const all = prompts.map((prompt, i) => {
          const [logits] = forwardBatch(m, kernels, [{ cache: createKvCache(m), tokens: prompt }]);
          expect(
            maxAbsDiff(logits!, torch.last_logits[i]!),
            `${storage}: prompt ${i}`,
          ).toBeLessThanOrEqual(1e-3);
          return logits!;
        });

        const cache = createKvCache(m);
        let logits = forwardBatch(m, kernels, [{ cache, tokens: prompts[0]! }])[0]!;
        const greedy: number[] = [];
        for (let t = 0; t < 20; t++) {
          const token = argmax(logits);
          greedy.push(token);
          logits = forwardBatch(m, kernels, [{ cache, tokens: [token] }])[0]!;
        }
        expect(greedy, storage).toEqual(torch.greedy);

        const trainer = new LoraTrainer(m, adapter, { kernels });
        const { loss } = trainer.backward(batch);
        expect(Math.abs(loss - torch.loss!), storage).toBeLessThanOrEqual(
          1e-4 * Math.max(1, Math.abs(loss)),
        );
        for (const p of loraParameters(trainer.grads)) {
          const expected = torch.grads![p.name]!;
          const scale = Math.max(...expected.map(Math.abs), 1e-6);
          expect(maxAbsDiff(p.data, expected) / scale, `${storage}: ${p.name}`).toBeLessThanOrEqual(
            2e-3,
          );
        }
        return all;
      }
    },
  );
});
