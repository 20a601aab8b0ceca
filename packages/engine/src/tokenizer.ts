import { Tokenizer as HfTokenizer } from "@huggingface/tokenizers";

/** A model folder's tokenizer files, as parsed JSON. */
export interface TokenizerFiles {
  /** `tokenizer.json`. */
  tokenizer: Record<string, unknown>;
  /** `tokenizer_config.json` (`{}` when the folder has none). */
  config: Record<string, unknown>;
}

/** A model folder's file that cannot be used; the message names the file. */
export class ModelFileError extends Error {
  override name = "ModelFileError";
  readonly file: string;
  constructor(file: string, why: string) {
    super(`${file}: ${why}`);
    this.file = file;
  }
}

interface AddedTokenJson {
  id: number;
  content: string;
  special?: boolean;
  lstrip?: boolean;
  rstrip?: boolean;
}

/** The tokenizer models the engine serves: byte-level BPE (Llama 3, Qwen, SmolLM, GPT-2…). */
const SUPPORTED_MODELS = new Set(["BPE"]);

/**
 * A model's own tokenizer, read from its `tokenizer.json` by `@huggingface/tokenizers` (normalizers,
 * pre-tokenizer regexes, added and special tokens as the model defines them).
 *
 * Special tokens are recognised in text only where the caller says so (`special: true`): a chat
 * template's markers are, a user's message text is not, so no message can inject a control token.
 */
export class Tokenizer {
  readonly files: TokenizerFiles;
  /** One past the largest id of the vocabulary and the added tokens. */
  readonly vocabSize: number;
  readonly #hf: HfTokenizer;
  /** The same tokenizer with its special tokens demoted to ordinary text (made on first use). */
  #plain: HfTokenizer | undefined;
  readonly #special = new Map<string, AddedTokenJson>();
  readonly #specialIds = new Set<number>();

  constructor(files: TokenizerFiles, where = "tokenizer.json") {
    this.files = files;
    const model = files.tokenizer.model as { type?: unknown; vocab?: unknown } | undefined;
    const type = model?.type;
    if (typeof type !== "string" || !SUPPORTED_MODELS.has(type)) {
      throw new ModelFileError(
        where,
        `tokenizer model ${JSON.stringify(type ?? null)} is not supported (supported: ${[...SUPPORTED_MODELS].join(", ")})`,
      );
    }
    try {
      this.#hf = new HfTokenizer(files.tokenizer, files.config);
    } catch (err) {
      throw new ModelFileError(where, (err as Error).message);
    }
    let size = 0;
    for (const id of Object.values((model?.vocab ?? {}) as Record<string, number>))
      size = Math.max(size, id + 1);
    for (const token of addedTokens(files)) {
      size = Math.max(size, token.id + 1);
      if (token.special) {
        this.#special.set(token.content, token);
        this.#specialIds.add(token.id);
      }
    }
    this.vocabSize = size;
  }

  /** The special tokens' texts (`<|im_end|>`…), longest first. */
  get specialTexts(): string[] {
    return [...this.#special.keys()].sort((a, b) => b.length - a.length);
  }

  /** The added token (special or not) spelt `content`, if any. */
  specialToken(content: string): AddedTokenJson | undefined {
    return this.#special.get(content);
  }

  /**
   * The ids of `text`. With `special`, special tokens written in it are their own ids (a chat
   * template's markers); without, they are spelt out as ordinary text (a user's words). Non-special
   * added tokens (`<think>`, `<tool_call>`) are always recognised, as the model expects.
   */
  encode(text: string, options: { special: boolean }): number[] {
    if (text.length === 0) return [];
    const tokenizer = options.special ? this.#hf : this.#plainTokenizer();
    return tokenizer.encode(text, { add_special_tokens: false }).ids;
  }

  /** The text of `ids`, special tokens included, exactly as the bytes decode (no clean-up of
   * spaces, which would make streamed pieces disagree with the whole). */
  decode(ids: readonly number[]): string {
    if (ids.length === 0) return "";
    return this.#hf.decode([...ids], {
      skip_special_tokens: false,
      clean_up_tokenization_spaces: false,
    });
  }

  /** The id of a token of the vocabulary or an added token, by its string. */
  tokenId(token: string): number | undefined {
    return this.#hf.token_to_id(token);
  }

  /** A token's string in the vocabulary (byte-level symbols for BPE). */
  token(id: number): string | undefined {
    return this.#hf.id_to_token(id);
  }

  /** The BPE merges, each as `"left right"` (GGUF's form). */
  merges(): string[] {
    const model = this.files.tokenizer.model as { merges?: (string | string[])[] } | undefined;
    return (model?.merges ?? []).map((m) => (Array.isArray(m) ? m.join(" ") : m));
  }

  /** llama.cpp's name for this tokenizer's pre-tokenizer (`ggufPreTokenizer`). */
  ggufPreTokenizer(): string | undefined {
    return ggufPreTokenizer(this.files.tokenizer);
  }

  isSpecial(id: number): boolean {
    return this.#specialIds.has(id);
  }

  /** The UTF-8 byte length of the longest non-special token's text: a prompt of n bytes takes at
   * least n / this many tokens. An upper bound (a byte-level symbol counts up to 2 bytes). */
  maxTokenBytes(): number {
    let longest = 1;
    for (let id = 0; id < this.vocabSize; id++) {
      if (this.#specialIds.has(id)) continue;
      const token = this.#hf.id_to_token(id);
      if (token) longest = Math.max(longest, Buffer.byteLength(token, "utf8"));
    }
    return longest;
  }

  #plainTokenizer(): HfTokenizer {
    if (!this.#plain) {
      if (this.#special.size === 0) {
        this.#plain = this.#hf;
      } else {
        const tokenizer = {
          ...this.files.tokenizer,
          added_tokens: addedTokens(this.files).filter((t) => !t.special),
        };
        const config = { ...this.files.config, added_tokens_decoder: {} };
        this.#plain = new HfTokenizer(tokenizer, config);
      }
    }
    return this.#plain;
  }
}

function addedTokens(files: TokenizerFiles): AddedTokenJson[] {
  const list = files.tokenizer.added_tokens;
  return Array.isArray(list) ? (list as AddedTokenJson[]) : [];
}

/**
 * The name llama.cpp gives a `tokenizer.json`'s pre-tokenizer (`tokenizer.ggml.pre`), which
 * decides how it splits text before BPE, recognised from the file's own pre-tokenizer; undefined
 * when llama.cpp has none that splits as it does (a GGUF would then tokenize differently, so none
 * is written).
 */
export function ggufPreTokenizer(tokenizerJson: Record<string, unknown>): string | undefined {
  const pre = tokenizerJson.pre_tokenizer as PreTokenizerJson | null | undefined;
  const steps = pre?.type === "Sequence" ? (pre.pretokenizers ?? []) : pre ? [pre] : [];
  const [first, byteLevel] = steps;
  if (steps.length !== 2 || byteLevel?.type !== "ByteLevel" || byteLevel.add_prefix_space)
    return undefined;
  if (first?.type === "Split" && byteLevel.use_regex === false) {
    const regex = first.pattern?.Regex;
    return Object.keys(GGUF_PRE_REGEX).find((name) => GGUF_PRE_REGEX[name] === regex);
  }
  // SmolLM's: every digit alone, then GPT-2's own split (ByteLevel with its regex).
  if (first?.type === "Digits" && first.individual_digits === true && byteLevel.use_regex !== false)
    return "smollm";
  return undefined;
}

/** A `tokenizer.json` pre-tokenizer, as far as `ggufPreTokenizer` reads it. */
interface PreTokenizerJson {
  type?: string;
  pretokenizers?: PreTokenizerJson[];
  pattern?: { Regex?: string };
  add_prefix_space?: boolean;
  use_regex?: boolean;
  individual_digits?: boolean;
}

/** The split patterns of llama.cpp's pre-tokenizers that tokenizer.json files spell out. */
const GGUF_PRE_REGEX: Record<string, string> = {
  // Llama 3 and 3.1/3.2: numbers in groups of up to three digits.
  "llama-bpe":
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
  // Qwen2, Qwen2.5 and Qwen3 (and tiny-chat): every digit alone.
  qwen2:
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
};
