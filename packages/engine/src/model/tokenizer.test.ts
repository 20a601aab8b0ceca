import { Tokenizer as HfTokenizer } from "@huggingface/tokenizers";
import { describe, expect, it, vi } from "vitest";
import { FAMILIES, familyTokenizerFiles, referenceEncoder } from "../../test/families.ts";
import { tinyChatFiles } from "../../test/fixtures.ts";
import {
  ModelFileError,
  TEXT_PIECE_CHARS,
  Tokenizer,
  type TokenizerFiles,
  TokenLimitError,
  WORD_PIECE_SYMBOLS,
} from "./tokenizer.ts";

const CORPUS = [
  "Hello, world! The quick brown fox jumps over the lazy dog.",
  "Héllo wörld — naïve café, Ærøskøbing, ß and İstanbul",
  "Emoji: 🙂👍🏽👨‍👩‍👧‍👦🇳🇴 and ✨",
  "中文测试：你好，世界！日本語のテキスト。한국어 문장입니다.",
  "Whitespace   runs\t\ttabs\n\n\nnewlines \r\n crlf    end   ",
  "Digits 1234567890 and 3.14159, 1,000,000 and 2026-11-25T02:44:20Z",
  'def add(a, b):\n    return a + b  # sum\n\nconsole.log(`x = $` + x); {"k": [1, 2]}',
  "Contractions: don't, it's, we're, I'LL, you've",
];

/** n lowercase letters from a fixed LCG: one word, no spaces. */
function letters(n: number): string {
  let seed = 7;
  let out = "";
  for (let i = 0; i < n; i++) {
    seed = (seed * 1103515245 + 12345) % 2 ** 31;
    out += String.fromCharCode(97 + ((seed >>> 16) % 26));
  }
  return out;
}

/**
 * The map lookups encoding `text` takes: BPE looks up a pair's merge rank for every candidate
 * pair it considers, so a rescan per merge shows as lookups growing with the square of a word's
 * length, and a queue of candidates as lookups growing with the length. Work counted, not timed.
 */
function lookups(tokenizer: Tokenizer, text: string): number {
  const get = vi.spyOn(Map.prototype, "get");
  try {
    tokenizer.encode(text, { special: false });
    return get.mock.calls.length;
  } finally {
    get.mockRestore();
  }
}

/** A word ten times longer takes about ten times the lookups, not a hundred. */
function expectLinearInWordLength(tokenizer: Tokenizer): void {
  const short = lookups(tokenizer, letters(5_000));
  const long = lookups(tokenizer, letters(50_000));
  expect(short).toBeGreaterThan(5_000);
  expect(long / short, `${short} then ${long} lookups`).toBeLessThan(15);
}

describe("Tokenizer (tiny-chat's)", () => {
  const tokenizer = new Tokenizer(tinyChatFiles().tokenizer);

  it("when text is encoded and decoded, then it round-trips, specials included", () => {
    for (const text of [...CORPUS, "<|im_start|>user\nHi<|im_end|>\n"]) {
      expect(tokenizer.decode(tokenizer.encode(text, { special: true })), text).toBe(text);
    }
  });

  it("when special tokens may not be parsed, then their text is spelt out as ordinary tokens", () => {
    const text = "say <|im_end|> now";
    const parsed = tokenizer.encode(text, { special: true });
    const plain = tokenizer.encode(text, { special: false });
    const imEnd = tokenizer.tokenId("<|im_end|>")!;
    expect(parsed).toContain(imEnd);
    expect(plain).not.toContain(imEnd);
    expect(plain.some((id) => tokenizer.isSpecial(id))).toBe(false);
    expect(tokenizer.decode(plain)).toBe(text);
  });

  it("when a word grows tenfold, then tokenizing it takes about tenfold the work", () => {
    expectLinearInWordLength(tokenizer);
  });

  it("when tokenizer.json is of a model type the engine does not serve, then the error names the file", () => {
    const files = tinyChatFiles().tokenizer;
    const wordPiece = { ...files.tokenizer, model: { type: "WordPiece", vocab: {} } };
    expect(
      () => new Tokenizer({ ...files, tokenizer: wordPiece }, "/models/x/tokenizer.json"),
    ).toThrow(
      new ModelFileError(
        "/models/x/tokenizer.json",
        'tokenizer model "WordPiece" is not supported (supported: BPE)',
      ),
    );
  });
});

describe.each(FAMILIES)("Tokenizer ($name's tokenizer.json)", (family) => {
  const tokenizer = new Tokenizer(familyTokenizerFiles(family));

  it("when the corpus is encoded, then decoding gives it back and the ids equal the second implementation's", async () => {
    const reference = await referenceEncoder(family);
    const specials = tokenizer.specialTexts.slice(0, 3).join(" x ");
    for (const text of [...CORPUS, specials, `${CORPUS[0]}${specials}${CORPUS[3]}`]) {
      const ids = tokenizer.encode(text, { special: true });
      expect(tokenizer.decode(ids), text).toBe(text);
      expect(ids, text).toEqual(reference(text));
    }
  });

  it("when a special token's text is not to be parsed, then no special id comes out and it still decodes", () => {
    const text = `before ${tokenizer.specialTexts.join(" ")} after`;
    const ids = tokenizer.encode(text, { special: false });
    expect(ids.filter((id) => tokenizer.isSpecial(id))).toEqual([]);
    expect(tokenizer.decode(ids)).toBe(text);
  });

  it("when a word has 100,000 letters, then it encodes (near-linear) and round-trips", () => {
    const word = "ab".repeat(50_000);
    expect(tokenizer.decode(tokenizer.encode(word, { special: false }))).toBe(word);
    expect(tokenizer.decode(tokenizer.encode(letters(100_000), { special: false }))).toBe(
      letters(100_000),
    );
    expectLinearInWordLength(tokenizer);
  });
});

/** Text with every kind of character the pre-tokenizers treat apart, in random runs: letters
 * (accented, combining, CJK), digits, punctuation, contractions, spaces, tabs, newlines, CRLF,
 * emoji, so that pieces are cut in every context `pieceCut` allows. */
function mixedText(length: number, seed: number): string {
  const parts = [
    "the",
    "Cat",
    "naïve",
    "cafe\u0301",
    "中文",
    "İstanbul",
    "don't",
    "it's",
    "WE'LL",
    "7",
    "12345",
    "3.14",
    "!",
    "?!",
    "...",
    '{"k": [1, 2]}',
    "🙂",
    "👍🏽",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n",
    "\n ",
    "-",
    "x",
  ];
  let state = seed;
  let out = "";
  while (out.length < length) {
    state = (state * 1103515245 + 12345) % 2 ** 31;
    out += parts[(state >>> 16) % parts.length];
  }
  return out;
}

const EVERY_TOKENIZER: [string, TokenizerFiles][] = [
  ["tiny-chat", tinyChatFiles().tokenizer],
  ...FAMILIES.map((f): [string, TokenizerFiles] => [f.name, familyTokenizerFiles(f)]),
];

describe.each(EVERY_TOKENIZER)("Tokenizer limits (%s)", (_name, files) => {
  const whole = new Tokenizer(files);

  it("when limited text is tokenized in small pieces, then the ids are the whole text's", () => {
    const pieces = new Tokenizer(files, "tokenizer.json", { pieceChars: 50 });
    const encode = vi.spyOn(HfTokenizer.prototype, "encode");
    try {
      for (const seed of [1, 2, 3]) {
        const text = `${mixedText(20_000, seed)}\n${CORPUS.join("\n")}`;
        for (const special of [true, false]) {
          const expected = whole.encode(text, { special });
          encode.mockClear();
          expect(pieces.encode(text, { special, limit: 1e9 })).toEqual(expected);
          expect(encode.mock.calls.length).toBeGreaterThan(100);
        }
      }
    } finally {
      encode.mockRestore();
    }
  });

  it("when limited text passes its limit, then tokenizing stops within its first piece", () => {
    const text = mixedText(4_000_000, 5);
    const encode = vi.spyOn(HfTokenizer.prototype, "encode");
    try {
      const refusal = (() => {
        try {
          whole.encode(text, { special: false, limit: 1000 });
        } catch (err) {
          return err;
        }
      })();
      expect(refusal).toBeInstanceOf(TokenLimitError);
      expect((refusal as TokenLimitError).tokens).toBeGreaterThanOrEqual(1000);
      const read = encode.mock.calls.reduce(
        (n: number, call: unknown[]) => n + String(call[0]).length,
        0,
      );
      expect(read).toBeLessThan(2 * TEXT_PIECE_CHARS);
    } finally {
      encode.mockRestore();
    }
  });

  it("when a word is longer than WORD_PIECE_SYMBOLS, then it is merged in pieces of that many, each as a word", () => {
    const word = letters(2 * WORD_PIECE_SYMBOLS + 1234);
    const pieces = [0, 1, 2].map((k) =>
      word.slice(k * WORD_PIECE_SYMBOLS, (k + 1) * WORD_PIECE_SYMBOLS),
    );
    expect(whole.encode(word, { special: false })).toEqual(
      pieces.flatMap((piece) => whole.encode(piece, { special: false })),
    );
  });

  it("when a word of three million letters is limited, then merging stops at the limit", () => {
    const word = letters(3_000_000);
    const lookups = vi.spyOn(Map.prototype, "get");
    try {
      expect(() => whole.encode(word, { special: false, limit: 100 })).toThrow(TokenLimitError);
      // One piece's merges, not three hundred pieces'.
      expect(lookups.mock.calls.length).toBeLessThan(10 * WORD_PIECE_SYMBOLS);
    } finally {
      lookups.mockRestore();
    }
  });
});
