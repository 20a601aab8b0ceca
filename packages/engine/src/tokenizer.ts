/** Byte-level BPE tokenizer in the Hugging Face tokenizer.json format (GPT-2 byte mapping). */

/** Qwen2-style split: single digits, so numbers are spelt digit by digit. */
export const DEFAULT_SPLIT_PATTERN =
  "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const GPT2_PATTERN =
  "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

export interface AddedToken {
  id: number;
  content: string;
  special: boolean;
}

const { byteToChar, charToByte } = byteMaps();

function byteMaps(): { byteToChar: string[]; charToByte: Map<string, number> } {
  const printable: number[] = [];
  for (let b = 33; b <= 126; b++) printable.push(b);
  for (let b = 161; b <= 172; b++) printable.push(b);
  for (let b = 174; b <= 255; b++) printable.push(b);
  const byteToChar: string[] = new Array(256);
  let extra = 0;
  for (let b = 0; b < 256; b++) {
    byteToChar[b] = printable.includes(b)
      ? String.fromCharCode(b)
      : String.fromCharCode(256 + extra++);
  }
  const charToByte = new Map(byteToChar.map((c, b) => [c, b]));
  return { byteToChar, charToByte };
}

/** The GPT-2 byte-to-unicode alphabet, in byte order. */
export function byteAlphabet(): string[] {
  return [...byteToChar];
}

export function bytesToSymbols(bytes: Uint8Array): string {
  let s = "";
  for (const b of bytes) s += byteToChar[b];
  return s;
}

export class Tokenizer {
  readonly vocab: Map<string, number>;
  readonly idToToken: string[];
  readonly merges: [string, string][];
  readonly addedTokens: AddedToken[];
  private readonly mergeRanks: Map<string, number>;
  private readonly splitRegex: RegExp;
  private readonly splitPattern: string;
  private readonly specialRegex: RegExp | null;
  private readonly addedByContent: Map<string, AddedToken>;
  private readonly cache = new Map<string, number[]>();
  private tokenBytesCache: Uint8Array[] | null = null;

  constructor(options: {
    vocab: Map<string, number>;
    merges: [string, string][];
    addedTokens: AddedToken[];
    splitPattern?: string;
  }) {
    this.vocab = options.vocab;
    this.merges = options.merges;
    this.addedTokens = options.addedTokens;
    this.splitPattern = options.splitPattern ?? DEFAULT_SPLIT_PATTERN;
    this.splitRegex = compileSplit(this.splitPattern);
    this.mergeRanks = new Map(options.merges.map(([a, b], i) => [`${a} ${b}`, i]));
    const size = Math.max(
      ...[...options.vocab.values()].map((id) => id + 1),
      ...options.addedTokens.map((t) => t.id + 1),
    );
    this.idToToken = new Array(size).fill("");
    for (const [token, id] of options.vocab) this.idToToken[id] = token;
    for (const t of options.addedTokens) this.idToToken[t.id] = t.content;
    this.addedByContent = new Map(options.addedTokens.map((t) => [t.content, t]));
    this.specialRegex =
      options.addedTokens.length > 0
        ? new RegExp(
            [...options.addedTokens]
              .sort((a, b) => b.content.length - a.content.length)
              .map((t) => t.content.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"))
              .join("|"),
            "g",
          )
        : null;
  }

  get vocabSize(): number {
    return this.idToToken.length;
  }

  tokenId(content: string): number | undefined {
    return this.addedByContent.get(content)?.id ?? this.vocab.get(content);
  }

  isSpecial(id: number): boolean {
    const token = this.idToToken[id];
    return token !== undefined && this.addedByContent.get(token)?.special === true;
  }

  /** Encodes text; added tokens (e.g. `<|im_end|>`) are recognised unless `allowSpecial` is false. */
  encode(text: string, options: { allowSpecial?: boolean } = {}): number[] {
    const ids: number[] = [];
    if (!this.specialRegex || options.allowSpecial === false) {
      this.encodeOrdinary(text, ids);
      return ids;
    }
    let last = 0;
    for (const match of text.matchAll(this.specialRegex)) {
      this.encodeOrdinary(text.slice(last, match.index), ids);
      ids.push(this.addedByContent.get(match[0])!.id);
      last = match.index + match[0].length;
    }
    this.encodeOrdinary(text.slice(last), ids);
    return ids;
  }

  private encodeOrdinary(text: string, ids: number[]): void {
    if (text.length === 0) return;
    const encoder = new TextEncoder();
    for (const match of text.matchAll(this.splitRegex)) {
      const word = bytesToSymbols(encoder.encode(match[0]));
      let cached = this.cache.get(word);
      if (!cached) {
        cached = this.bpe(word);
        if (this.cache.size < 50_000) this.cache.set(word, cached);
      }
      for (const id of cached) ids.push(id);
    }
  }

  private bpe(word: string): number[] {
    let parts = [...word];
    while (parts.length > 1) {
      let best = -1;
      let bestRank = Number.POSITIVE_INFINITY;
      for (let i = 0; i < parts.length - 1; i++) {
        const rank = this.mergeRanks.get(`${parts[i]} ${parts[i + 1]}`);
        if (rank !== undefined && rank < bestRank) {
          bestRank = rank;
          best = i;
        }
      }
      if (best < 0) break;
      parts = [...parts.slice(0, best), parts[best]! + parts[best + 1]!, ...parts.slice(best + 2)];
    }
    return parts.map((p) => {
      const id = this.vocab.get(p);
      if (id === undefined) throw new Error(`tokenizer: no id for symbol ${JSON.stringify(p)}`);
      return id;
    });
  }

  /** The raw bytes a token stands for (added tokens: their UTF-8 text). */
  tokenBytes(id: number): Uint8Array {
    if (!this.tokenBytesCache) {
      this.tokenBytesCache = this.idToToken.map((token) => {
        if (this.addedByContent.has(token)) return new TextEncoder().encode(token);
        const bytes: number[] = [];
        for (const c of token) bytes.push(charToByte.get(c) ?? 0x3f);
        return Uint8Array.from(bytes);
      });
    }
    return this.tokenBytesCache[id] ?? new Uint8Array();
  }

  decode(ids: readonly number[], options: { skipSpecial?: boolean } = {}): string {
    const chunks: Uint8Array[] = [];
    for (const id of ids) {
      if (options.skipSpecial && this.isSpecial(id)) continue;
      chunks.push(this.tokenBytes(id));
    }
    const total = chunks.reduce((n, c) => n + c.length, 0);
    const bytes = new Uint8Array(total);
    let offset = 0;
    for (const c of chunks) {
      bytes.set(c, offset);
      offset += c.length;
    }
    return new TextDecoder().decode(bytes);
  }

  static fromJson(json: unknown): Tokenizer {
    const root = json as {
      model?: { type?: string; vocab?: Record<string, number>; merges?: (string | string[])[] };
      added_tokens?: { id: number; content: string; special?: boolean }[];
      pre_tokenizer?: unknown;
    };
    const model = root.model;
    if (model?.type !== "BPE" || !model.vocab) {
      throw new Error("tokenizer.json: only BPE models are supported");
    }
    const merges = (model.merges ?? []).map((m): [string, string] => {
      if (Array.isArray(m)) return [m[0] ?? "", m[1] ?? ""];
      const space = m.indexOf(" ", 1);
      return [m.slice(0, space), m.slice(space + 1)];
    });
    return new Tokenizer({
      vocab: new Map(Object.entries(model.vocab)),
      merges,
      addedTokens: (root.added_tokens ?? []).map((t) => ({
        id: t.id,
        content: t.content,
        special: t.special ?? false,
      })),
      splitPattern: findSplitPattern(root.pre_tokenizer),
    });
  }

  toJson(): Record<string, unknown> {
    const vocab: Record<string, number> = {};
    for (const [token, id] of [...this.vocab].sort((a, b) => a[1] - b[1])) vocab[token] = id;
    return {
      version: "1.0",
      truncation: null,
      padding: null,
      added_tokens: this.addedTokens.map((t) => ({
        id: t.id,
        content: t.content,
        single_word: false,
        lstrip: false,
        rstrip: false,
        normalized: false,
        special: t.special,
      })),
      normalizer: null,
      pre_tokenizer: {
        type: "Sequence",
        pretokenizers: [
          {
            type: "Split",
            pattern: { Regex: this.splitPattern },
            behavior: "Isolated",
            invert: false,
          },
          { type: "ByteLevel", add_prefix_space: false, trim_offsets: false, use_regex: false },
        ],
      },
      post_processor: null,
      decoder: {
        type: "ByteLevel",
        add_prefix_space: false,
        trim_offsets: false,
        use_regex: false,
      },
      model: {
        type: "BPE",
        dropout: null,
        unk_token: null,
        continuing_subword_prefix: null,
        end_of_word_suffix: null,
        fuse_unk: false,
        byte_fallback: false,
        ignore_merges: false,
        vocab,
        merges: this.merges.map(([a, b]) => [a, b]),
      },
    };
  }
}

function compileSplit(pattern: string): RegExp {
  try {
    return new RegExp(pattern, "gu");
  } catch {
    return new RegExp(GPT2_PATTERN, "gu");
  }
}

function findSplitPattern(pre: unknown): string {
  const node = pre as {
    type?: string;
    pretokenizers?: unknown[];
    pattern?: { Regex?: string };
    use_regex?: boolean;
  } | null;
  if (!node) return GPT2_PATTERN;
  if (node.type === "Split" && node.pattern?.Regex) return node.pattern.Regex;
  if (node.type === "Sequence") {
    for (const child of node.pretokenizers ?? []) {
      const c = child as { type?: string };
      if (c.type === "Split") return findSplitPattern(child);
    }
  }
  return GPT2_PATTERN;
}

/**
 * Trains byte-level BPE merges on a corpus: counts pre-tokenized words, then repeatedly merges
 * the most frequent adjacent pair (ties broken by the pair's text, so training is deterministic).
 */
export function trainBpe(
  corpus: Iterable<string>,
  options: { vocabSize: number; specialTokens: string[]; splitPattern?: string },
): Tokenizer {
  const splitPattern = options.splitPattern ?? DEFAULT_SPLIT_PATTERN;
  const regex = compileSplit(splitPattern);
  const encoder = new TextEncoder();
  const wordCounts = new Map<string, number>();
  for (const text of corpus) {
    for (const match of text.matchAll(regex)) {
      const word = bytesToSymbols(encoder.encode(match[0]));
      wordCounts.set(word, (wordCounts.get(word) ?? 0) + 1);
    }
  }
  const words = [...wordCounts].map(([w, count]) => ({ parts: [...w], count }));
  const vocab = new Map<string, number>();
  for (const c of byteToChar) vocab.set(c, vocab.size);
  const merges: [string, string][] = [];
  const target = options.vocabSize - options.specialTokens.length;
  while (vocab.size < target) {
    const pairCounts = new Map<string, number>();
    for (const { parts, count } of words) {
      for (let i = 0; i < parts.length - 1; i++) {
        const key = `${parts[i]} ${parts[i + 1]}`;
        pairCounts.set(key, (pairCounts.get(key) ?? 0) + count);
      }
    }
    let best = "";
    let bestCount = 0;
    for (const [key, count] of pairCounts) {
      if (count > bestCount || (count === bestCount && key < best)) {
        best = key;
        bestCount = count;
      }
    }
    if (bestCount < 2) break;
    const space = best.indexOf(" ", 1);
    const a = best.slice(0, space);
    const b = best.slice(space + 1);
    merges.push([a, b]);
    vocab.set(a + b, vocab.size);
    for (const word of words) {
      const parts = word.parts;
      for (let i = 0; i < parts.length - 1; i++) {
        if (parts[i] === a && parts[i + 1] === b) parts.splice(i, 2, a + b);
      }
    }
  }
  const addedTokens = options.specialTokens.map((content, i) => ({
    id: vocab.size + i,
    content,
    special: true,
  }));
  return new Tokenizer({ vocab, merges, addedTokens, splitPattern });
}
