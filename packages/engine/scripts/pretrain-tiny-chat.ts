/**
 * Reproducibly pretrains models/tiny-chat from synthetic ChatML dialogues (see
 * synthetic-chat.ts). Usage: `nice node scripts/pretrain-tiny-chat.ts [outDir] [steps]`.
 * Everything derives from SEED: the BPE corpus, the training stream and the initial weights.
 */
import { fileURLToPath } from "node:url";
import { createWasmKernels } from "../src/kernels/wasm.ts";
import type { ChatFiles } from "../src/model/chat.ts";
import type { ModelConfig } from "../src/model/config.ts";
import { createKvCache, forwardBatch } from "../src/model/forward.ts";
import { createModel, parameterCount, saveModel } from "../src/model/model.ts";
import { Rng } from "../src/model/rng.ts";
import { initWeights } from "../src/model/weights.ts";
import { Trainer } from "../src/train/optim.ts";
import type { TrainBatch } from "../src/train/train.ts";
import { trainBpe } from "./bpe.ts";
import { syntheticDialogue } from "./synthetic-chat.ts";
import { TINY_CHAT_TEMPLATE } from "./tiny-chat-template.ts";

const END_OF_TEXT = "<|endoftext|>";
const IM_START = "<|im_start|>";
const IM_END = "<|im_end|>";

const SEED = 20261123;
const VOCAB = 768;
const BATCH = 16;
const SEQ = 128;
const outDir = process.argv[2] ?? fileURLToPath(new URL("../models/tiny-chat/", import.meta.url));
const steps = Number(process.argv[3] ?? 1600);

const textRng = new Rng(SEED);
const bpeCorpus = Array.from({ length: 20_000 }, () => {
  const messages = syntheticDialogue(textRng);
  return messages.map((m) => `${m.role}\n${m.content}`).join("\n");
});
const tokenizer = trainBpe(bpeCorpus, {
  vocabSize: VOCAB,
  specialTokens: [END_OF_TEXT, IM_START, IM_END],
});
const endOfText = tokenizer.tokenId(END_OF_TEXT)!;
const imEnd = tokenizer.tokenId(IM_END)!;

const config: ModelConfig = {
  modelType: "llama",
  ropeScaling: null,
  ropeLayers: null,
  qkvBias: false,
  oBias: false,
  qkNorm: false,
  hiddenSize: 128,
  intermediateSize: 352,
  numLayers: 4,
  numHeads: 2,
  numKvHeads: 1,
  headDim: 64,
  vocabSize: tokenizer.vocabSize,
  maxPositions: 256,
  rmsNormEps: 1e-5,
  ropeTheta: 10000,
  tieWordEmbeddings: true,
  bosTokenId: endOfText,
  eosTokenId: [imEnd, endOfText],
};
const tokenizerJson = tokenizer.toJson();
const files: ChatFiles = {
  tokenizer: {
    tokenizer: tokenizerJson,
    config: {
      tokenizer_class: "PreTrainedTokenizerFast",
      add_bos_token: false,
      add_eos_token: false,
      bos_token: END_OF_TEXT,
      eos_token: IM_END,
      pad_token: END_OF_TEXT,
      model_max_length: 256,
      clean_up_tokenization_spaces: false,
      added_tokens_decoder: Object.fromEntries(
        tokenizer.addedTokens.map((a) => [
          String(a.id),
          {
            content: a.content,
            lstrip: false,
            rstrip: false,
            normalized: false,
            single_word: false,
            special: a.special,
          },
        ]),
      ),
    },
  },
  tokenizerFile: "tokenizer.json",
  template: TINY_CHAT_TEMPLATE,
  templateFile: "tokenizer_config.json",
  generation: { eosTokenId: [], raw: {} },
};
const model = createModel(config, initWeights(config, SEED + 1), files);
console.log(
  `tiny-chat: ${parameterCount(model)} parameters, vocab ${tokenizer.vocabSize}, ${steps} steps of ${BATCH}×${SEQ}`,
);

// Dialogues rendered to ChatML and packed end to end, separated by <|endoftext|>.
const streamRng = new Rng(SEED + 2);
let stream: number[] = [];
function nextBatch(): TrainBatch {
  const need = BATCH * (SEQ + 1);
  while (stream.length < need) {
    stream.push(...model.chat.encode(syntheticDialogue(streamRng)), endOfText);
  }
  const inputs = new Int32Array(BATCH * SEQ);
  const targets = new Int32Array(BATCH * SEQ);
  for (let b = 0; b < BATCH; b++) {
    for (let t = 0; t < SEQ; t++) {
      inputs[b * SEQ + t] = stream[b * (SEQ + 1) + t]!;
      targets[b * SEQ + t] = stream[b * (SEQ + 1) + t + 1]!;
    }
  }
  stream = stream.slice(need);
  return {
    batchSize: BATCH,
    seqLen: SEQ,
    inputs,
    targets,
    lossMask: new Float32Array(BATCH * SEQ).fill(1),
  };
}

const kernels = createWasmKernels();
const trainer = new Trainer(model, kernels, {
  schedule: { kind: "cosine", peak: 3e-3, warmupSteps: 30, totalSteps: steps, minRatio: 0.1 },
  adamW: { beta1: 0.9, beta2: 0.95, weightDecay: 0.1 },
  maxGradNorm: 1,
});
const started = performance.now();
let window = 0;
for (let step = 0; step < steps; step++) {
  const result = trainer.step(nextBatch());
  window += result.loss;
  if ((step + 1) % 25 === 0) {
    const seconds = (performance.now() - started) / 1000;
    const tps = ((step + 1) * BATCH * SEQ) / seconds;
    console.log(
      `step ${step + 1} loss ${(window / 25).toFixed(3)} lr ${result.lr.toExponential(2)} ${tps.toFixed(0)} tok/s ${seconds.toFixed(0)} s`,
    );
    window = 0;
  }
}

function greedy(question: string): string {
  const prompt = model.chat.encode([{ role: "user", content: question }], {
    addGenerationPrompt: true,
  });
  const cache = createKvCache(model);
  let logits = forwardBatch(model, kernels, [{ cache, tokens: prompt }])[0]!;
  const out: number[] = [];
  for (let i = 0; i < 40; i++) {
    let best = 0;
    for (let v = 1; v < logits.length; v++) if (logits[v]! > logits[best]!) best = v;
    if (best === imEnd) break;
    out.push(best);
    logits = forwardBatch(model, kernels, [{ cache, tokens: [best] }])[0]!;
  }
  return model.tokenizer.decode(out);
}
for (const prompt of [
  "What is 7 + 5?",
  "Uppercase the word horse.",
  "Hello!",
  "Is a cow an animal?",
  "Reverse the word cat.",
  "What is 3 + 4? Answer in JSON.",
]) {
  console.log(`${JSON.stringify(prompt)} -> ${JSON.stringify(greedy(prompt))}`);
}
await saveModel(model, outDir);
console.log(`saved to ${outDir} after ${((performance.now() - started) / 1000).toFixed(0)} s`);
