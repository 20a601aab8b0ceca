/**
 * The hand-written byte-level BPE: the trainer that builds tiny-chat's vocabulary, and the encoder it
 * used before the engine read tokenizer.json with @huggingface/tokenizers (kept to rebuild
 * tiny-chat and as the baseline of bench/tokenizers.ts). Nothing at run time uses it.
 */

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

export class BpeTokenizer {
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

  /**
   * Merges a pre-token's symbols, lowest merge rank first (leftmost among equals), as every BPE
   * does; a priority queue of candidate pairs over a linked list keeps it O(n log n) in the
   * pre-token's length (a rescan per merge was quadratic: 20,000 letters took 10 s).
   */
  private bpe(word: string): number[] {
    const symbols = [...word];
    const n = symbols.length;
    const next = Int32Array.from({ length: n }, (_, i) => (i + 1 < n ? i + 1 : -1));
    const prev = Int32Array.from({ length: n }, (_, i) => i - 1);
    const queue = new PairQueue();
    const rankAt = (left: number): number | undefined => {
      const right = next[left]!;
      return right < 0 ? undefined : this.mergeRanks.get(`${symbols[left]} ${symbols[right]}`);
    };
    const offer = (left: number) => {
      const rank = rankAt(left);
      if (rank !== undefined) queue.push(rank, left);
    };
    for (let i = 0; i + 1 < n; i++) offer(i);
    for (let top = queue.pop(); top; top = queue.pop()) {
      const [rank, left] = top;
      // Stale entries (a side was merged since) no longer name the pair they were queued for.
      if (symbols[left] === "" || rankAt(left) !== rank) continue;
      const right = next[left]!;
      symbols[left] = symbols[left]! + symbols[right]!;
      symbols[right] = "";
      next[left] = next[right]!;
      if (next[left]! >= 0) prev[next[left]!] = left;
      if (prev[left]! >= 0) offer(prev[left]!);
      offer(left);
    }
    const ids: number[] = [];
    for (let i = 0; i >= 0 && i < n; i = next[i]!) {
      const id = this.vocab.get(symbols[i]!);
      if (id === undefined)
        throw new Error(`tokenizer: no id for symbol ${JSON.stringify(symbols[i])}`);
      ids.push(id);
    }
    return ids;
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

  static fromJson(json: unknown): BpeTokenizer {
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
    return new BpeTokenizer({
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
): BpeTokenizer {
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
  return new BpeTokenizer({ vocab, merges, addedTokens, splitPattern });
}

/** A binary min-heap of (rank, position) merge candidates; ties go to the leftmost position. */
class PairQueue {
  readonly #ranks: number[] = [];
  readonly #positions: number[] = [];

  push(rank: number, position: number): void {
    const ranks = this.#ranks;
    const positions = this.#positions;
    let i = ranks.length;
    ranks.push(rank);
    positions.push(position);
    while (i > 0) {
      const parent = (i - 1) >> 1;
      if (!this.#less(i, parent)) break;
      this.#swap(i, parent);
      i = parent;
    }
  }

  pop(): [number, number] | undefined {
    const ranks = this.#ranks;
    const positions = this.#positions;
    if (ranks.length === 0) return undefined;
    const top: [number, number] = [ranks[0]!, positions[0]!];
    const lastRank = ranks.pop()!;
    const lastPosition = positions.pop()!;
    if (ranks.length > 0) {
      ranks[0] = lastRank;
      positions[0] = lastPosition;
      let i = 0;
      for (;;) {
        const l = 2 * i + 1;
        const r = l + 1;
        let m = i;
        if (l < ranks.length && this.#less(l, m)) m = l;
        if (r < ranks.length && this.#less(r, m)) m = r;
        if (m === i) break;
        this.#swap(i, m);
        i = m;
      }
    }
    return top;
  }

  #less(a: number, b: number): boolean {
    const ra = this.#ranks[a]!;
    const rb = this.#ranks[b]!;
    return ra < rb || (ra === rb && this.#positions[a]! < this.#positions[b]!);
  }

  #swap(a: number, b: number): void {
    const ranks = this.#ranks;
    const positions = this.#positions;
    [ranks[a], ranks[b]] = [ranks[b]!, ranks[a]!];
    [positions[a], positions[b]] = [positions[b]!, positions[a]!];
  }
}
