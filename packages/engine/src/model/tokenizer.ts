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
 * A word (pre-token) of more than this many symbols (UTF-16 units; bytes, for byte-level BPE)
 * is merged in consecutive pieces of this many, each as a word of its own. Merging one word
 * keeps each of its symbols in memory several times over (about 270 bytes a letter) and slows
 * as the word grows (Llama 3's: 1.1 µs a letter at 10,000 letters, 12 at a million); in pieces
 * it stays linear. No vocabulary entry comes near this length (the longest are 256 bytes), and
 * text whose words are no longer is tokenized exactly as Hugging Face's tokenizers do; a longer
 * word's tokens may differ next to a piece boundary, which no merge crosses (a 100,000-letter
 * word: 2 to 5 tokens more in some 50,000, at 6 to 10 places).
 */
export const WORD_PIECE_SYMBOLS = 10_000;

/**
 * Text longer than this many characters, encoded with a token limit, is tokenized in pieces of
 * at least this many, so tokenizing stops soon after the limit instead of going through all
 * of a document that cannot fit.
 */
export const TEXT_PIECE_CHARS = 65_536;

/** The text takes at least `tokens` tokens, more than the limit it was encoded with; the rest
 * of it was not tokenized. */
export class TokenLimitError extends Error {
  override readonly name = "TokenLimitError";
  readonly tokens: number;
  constructor(tokens: number) {
    super(`the text takes at least ${tokens} tokens`);
    this.tokens = tokens;
  }
}

/** What `Tokenizer` uses of @huggingface/tokenizers' BPE model. */
interface BpeModel {
  bpe(word: string): string[];
  tokens_to_ids: Map<string, number>;
  config: { end_of_word_suffix?: unknown };
  continuing_subword_suffix?: unknown;
}

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
  /** Whether text may be cut into pieces at `pieceCut`'s places and tokenized piece by piece
   * with the same result: the pre-tokenizer is one whose splits are known there. */
  readonly #pieceSafe: boolean;
  readonly #pieceChars: number;
  /** Tokens a limited encode may still make before it stops (counted as words are merged). */
  #budget = Number.POSITIVE_INFINITY;

  constructor(
    files: TokenizerFiles,
    where = "tokenizer.json",
    options: { pieceChars?: number } = {},
  ) {
    this.files = files;
    this.#pieceChars = options.pieceChars ?? TEXT_PIECE_CHARS;
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
    this.#mergeInPieces(this.#hf);
    this.#pieceSafe = pieceSafe(files);
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
   *
   * With `limit`, TokenLimitError once the ids reach it: long text is then tokenized in pieces
   * (cut where the pre-tokenizer splits anyway, so the ids are the same), and tokenizing stops
   * at the piece, or the word, where the count reaches the limit.
   */
  encode(text: string, options: { special: boolean; limit?: number }): number[] {
    if (text.length === 0) return [];
    const tokenizer = options.special ? this.#hf : this.#plainTokenizer();
    const limit = options.limit ?? Number.POSITIVE_INFINITY;
    if (limit === Number.POSITIVE_INFINITY) {
      return tokenizer.encode(text, { add_special_tokens: false }).ids;
    }
    const ids: number[] = [];
    try {
      for (const piece of this.#pieces(text)) {
        this.#budget = limit - ids.length;
        let part: number[];
        try {
          part = tokenizer.encode(piece, { add_special_tokens: false }).ids;
        } catch (err) {
          // Stopped within the piece: its words so far took at least the rest of the budget.
          if (err instanceof TokenLimitError) throw new TokenLimitError(limit - this.#budget);
          throw err;
        }
        for (const id of part) ids.push(id);
        if (ids.length >= limit) throw new TokenLimitError(ids.length);
      }
    } finally {
      this.#budget = Number.POSITIVE_INFINITY;
    }
    return ids;
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
        this.#mergeInPieces(this.#plain);
      }
    }
    return this.#plain;
  }

  /**
   * Has `tokenizer`'s BPE merge a word of more than WORD_PIECE_SYMBOLS symbols in pieces, and
   * count what it merges against the budget of a limited encode (only tokens of the vocabulary,
   * each one id, so the count is a lower bound): a word of millions of letters stops at the
   * limit instead of being merged to its end. Models with end-of-word or continuing-subword
   * suffixes, whose pieces would not be words, merge every word whole.
   */
  #mergeInPieces(tokenizer: HfTokenizer): void {
    const model = tokenizer.model as unknown as BpeModel | null;
    if (!model || typeof model.bpe !== "function") return;
    const bpe = model.bpe.bind(model);
    const whole = Boolean(model.config.end_of_word_suffix || model.continuing_subword_suffix);
    const spend = (tokens: readonly string[]) => {
      if (this.#budget === Number.POSITIVE_INFINITY) return;
      for (const token of tokens) if (model.tokens_to_ids.has(token)) this.#budget--;
      if (this.#budget <= 0) throw new TokenLimitError(0);
    };
    model.bpe = (word: string): string[] => {
      if (whole || word.length <= WORD_PIECE_SYMBOLS) {
        const tokens = bpe(word);
        spend(tokens);
        return tokens;
      }
      const tokens: string[] = [];
      for (let at = 0; at < word.length; ) {
        let end = Math.min(word.length, at + WORD_PIECE_SYMBOLS);
        // A character outside the BMP stays whole (byte-level symbols are all within it).
        if (end < word.length && /[\uD800-\uDBFF]/.test(word[end - 1]!)) end--;
        const piece = bpe(word.slice(at, end));
        for (const token of piece) tokens.push(token);
        spend(piece);
        at = end;
      }
      return tokens;
    };
  }

  /** `text` in pieces of at least `#pieceChars` characters, each cut at a `pieceCut` place; in
   * one piece when the tokenizer is not one whose splits are known there. */
  *#pieces(text: string): Generator<string> {
    if (!this.#pieceSafe || text.length <= this.#pieceChars) {
      yield text;
      return;
    }
    let start = 0;
    while (text.length - start > this.#pieceChars) {
      const cut = pieceCut(text, start + this.#pieceChars);
      if (cut < 0) break;
      yield text.slice(start, cut);
      start = cut;
    }
    yield text.slice(start);
  }
}

/**
 * Where text can be cut so that both sides tokenize as they would within the whole: before a
 * space between two letters (every pre-tokenizer below ends a word at the space and starts the
 * next with it) or after a newline between two non-space characters (it ends its pre-token
 * either way, and the next begins after it). The first such place at or after `from`, or -1.
 */
export function pieceCut(text: string, from: number): number {
  PIECE_CUT.lastIndex = from;
  const match = PIECE_CUT.exec(text);
  if (!match) return -1;
  return match[0] === "\n" ? match.index + 1 : match.index;
}

const PIECE_CUT = /(?<=\p{L}) (?=\p{L})|(?<=\S)\n(?=\S)/gu;

/**
 * Whether `pieceCut`'s places are places the tokenizer splits anyway, so text cut there
 * tokenizes as the whole: the pre-tokenizers llama.cpp names (Llama 3's and Qwen2's split
 * patterns, SmolLM's digits then GPT-2's pattern), no normalizer but NFC (which joins nothing
 * across a space or a newline), no added token with whitespace in it or stripping the
 * whitespace beside it.
 */
function pieceSafe(files: TokenizerFiles): boolean {
  const normalizer = files.tokenizer.normalizer as { type?: string } | null | undefined;
  if (normalizer && normalizer.type !== "NFC") return false;
  if (files.config.remove_space === true || files.config.do_lowercase_and_remove_accent === true)
    return false;
  if (ggufPreTokenizer(files.tokenizer) === undefined) return false;
  return addedTokens(files).every((t) => !t.lstrip && !t.rstrip && !/\s/u.test(t.content));
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
