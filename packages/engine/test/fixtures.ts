import { cpSync, mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { trainBpe } from "../scripts/bpe.ts";
import { TINY_CHAT_TEMPLATE } from "../scripts/tiny-chat-template.ts";
import { catalogModelDir } from "../src/model/catalog.ts";
import type { ChatFiles } from "../src/model/chat.ts";
import type { ModelConfig } from "../src/model/config.ts";
import { createModel, type Model } from "../src/model/model.ts";
import { Rng } from "../src/model/rng.ts";
import { Tokenizer } from "../src/model/tokenizer.ts";
import { initWeights } from "../src/model/weights.ts";
import type { TrainBatch } from "../src/train/train.ts";

const sampleCorpus = [
  "Hello there! What is 7 + 5? 7 + 5 = 12.",
  "The cat sat on the mat. The dog sat on the log.",
  'Answer in JSON: {"name": "Ada", "age": 36, "ok": true}',
  "Reverse the word apple: elppa. Uppercase: APPLE.",
];

/** tiny-chat's format (its template and special tokens) over a small vocabulary. */
export function tinyChatFiles(vocabSize = 300): ChatFiles {
  const bpe = trainBpe(sampleCorpus, {
    vocabSize,
    specialTokens: ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
  });
  return {
    tokenizer: {
      tokenizer: bpe.toJson(),
      config: {
        bos_token: "<|endoftext|>",
        eos_token: "<|im_end|>",
        clean_up_tokenization_spaces: false,
      },
    },
    tokenizerFile: "tokenizer.json",
    template: TINY_CHAT_TEMPLATE,
    templateFile: "tokenizer_config.json",
    generation: { eosTokenId: [], raw: {} },
  };
}

export function tinyTokenizer(vocabSize = 300): Tokenizer {
  return new Tokenizer(tinyChatFiles(vocabSize).tokenizer);
}

export function tinyConfig(vocabSize: number, overrides: Partial<ModelConfig> = {}): ModelConfig {
  return {
    modelType: "llama",
    ropeScaling: null,
    ropeLayers: null,
    qkvBias: false,
    oBias: false,
    qkNorm: false,
    hiddenSize: 16,
    intermediateSize: 24,
    numLayers: 2,
    numHeads: 2,
    numKvHeads: 1,
    headDim: 8,
    vocabSize,
    maxPositions: 64,
    rmsNormEps: 1e-5,
    ropeTheta: 10000,
    tieWordEmbeddings: false,
    bosTokenId: null,
    eosTokenId: [vocabSize - 1],
    ...overrides,
  };
}

/** A small random model; weights are scaled up so logits differ visibly between tokens. */
export function tinyModel(seed = 1, overrides: Partial<ModelConfig> = {}): Model<Float32Array> {
  const files = tinyChatFiles();
  const config = tinyConfig(new Tokenizer(files.tokenizer).vocabSize, overrides);
  const weights = initWeights(config, seed);
  const boost = (a: Float32Array) => {
    for (let i = 0; i < a.length; i++) a[i] = a[i]! * 8;
  };
  boost(weights.embed);
  for (const layer of weights.layers) {
    for (const w of [layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down])
      boost(w);
  }
  if (weights.lmHead) boost(weights.lmHead);
  return createModel(config, weights, files);
}

/** B random sequences of T tokens with random targets; about 70 % of positions trained. */
export function randomBatch(vocab: number, B: number, T: number, seed: number): TrainBatch {
  const rng = new Rng(seed);
  const inputs = new Int32Array(B * T);
  const targets = new Int32Array(B * T);
  const lossMask = new Float32Array(B * T);
  for (let i = 0; i < B * T; i++) {
    inputs[i] = rng.int(vocab);
    targets[i] = rng.int(vocab);
    lossMask[i] = rng.next() < 0.7 ? 1 : 0;
  }
  return { batchSize: B, seqLen: T, inputs, targets, lossMask };
}

/**
 * A copy of the shipped tiny-chat in a new temp folder whose context is `context` tokens
 * (131,072 by default, as Llama 3.1's): its prompts of tens of thousands of tokens fit, so they
 * are really tokenized and prefilled rather than refused. The caller removes the folder.
 */
export function longContextTinyChat(context = 131_072): string {
  const dir = mkdtempSync(join(tmpdir(), "arbor-long-context-"));
  cpSync(catalogModelDir("arbor/tiny-chat"), dir, { recursive: true });
  const config = JSON.parse(readFileSync(join(dir, "config.json"), "utf8")) as Record<
    string,
    unknown
  >;
  writeFileSync(
    join(dir, "config.json"),
    JSON.stringify({ ...config, max_position_embeddings: context }, null, 2),
  );
  return dir;
}
