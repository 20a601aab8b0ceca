import { describe, expect, it } from "vitest";
import { Tokenizer } from "../src/model/tokenizer.ts";
import { BpeTokenizer, trainBpe } from "./bpe.ts";

/** The hand-written BPE that builds tiny-chat's vocabulary; the engine reads what it writes with
 * @huggingface/tokenizers, and both must agree. */
describe("BpeTokenizer", () => {
  const tokenizer = trainBpe(
    [
      "Hello there! What is 7 + 5? 7 + 5 = 12.",
      "The cat sat on the mat. The dog sat on the log.",
      'Answer in JSON: {"name": "Ada", "age": 36, "ok": true}',
      "Reverse the word apple: elppa. Uppercase: APPLE.",
    ],
    { vocabSize: 300, specialTokens: ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] },
  );

  it("when text is encoded and decoded, then it round-trips, including non-ASCII and specials", () => {
    const text = "<|im_start|>user\nHéllo wörld 123 🙂 The cat!<|im_end|>\n";
    const ids = tokenizer.encode(text);
    expect(tokenizer.decode(ids)).toBe(text);
    expect(ids[0]).toBe(tokenizer.tokenId("<|im_start|>"));
  });

  it("when trained, then frequent words become single tokens and digits stay single", () => {
    expect(tokenizer.encode("The cat sat on the mat.").length).toBeLessThan(12);
    expect(tokenizer.encode("123").length).toBe(3);
    expect(tokenizer.merges.length).toBeGreaterThan(10);
  });

  it("when written to tokenizer.json and read back, then it encodes identically, and so does @huggingface/tokenizers", () => {
    const json = JSON.parse(JSON.stringify(tokenizer.toJson()));
    expect(json.model.type).toBe("BPE");
    expect(json.pre_tokenizer.pretokenizers[1].type).toBe("ByteLevel");
    const again = BpeTokenizer.fromJson(json);
    const hf = new Tokenizer({ tokenizer: json, config: {} });
    for (const text of [
      "The dog sat on 7 + 5 = 12. <|endoftext|>",
      "Héllo   wörld!\n\n  spaces\ttabs 🙂 don't it's",
      '{"answer": 12, "ok": true}',
    ]) {
      expect(again.encode(text)).toEqual(tokenizer.encode(text));
      expect(hf.encode(text, { special: true }), text).toEqual(tokenizer.encode(text));
    }
    expect(again.vocabSize).toBe(tokenizer.vocabSize);
    expect(hf.vocabSize).toBe(tokenizer.vocabSize);
  });

  it("when a GPT-2 style tokenizer.json with string merges is read, then it applies them", () => {
    const vocab: Record<string, number> = { h: 0, e: 1, he: 2, Ġ: 3, Ġhe: 4 };
    const t = BpeTokenizer.fromJson({
      model: { type: "BPE", vocab, merges: ["h e", "Ġ he"] },
      added_tokens: [],
      pre_tokenizer: { type: "ByteLevel", add_prefix_space: false, use_regex: true },
    });
    expect(t.encode("he he")).toEqual([2, 4]);
  });

  it("when words are merged, then the ids equal a rescanning reference BPE's, and a 100,000-letter word still encodes", () => {
    const json = tokenizer.toJson() as { model: { vocab: Record<string, number> } };
    const ranks = new Map(tokenizer.merges.map(([a, b], i) => [`${a} ${b}`, i] as const));
    // The textbook loop: merge the lowest-ranked adjacent pair (leftmost among equals) until none.
    const reference = (word: string) => {
      let parts = [...word];
      for (;;) {
        let best = -1;
        let bestRank = Number.POSITIVE_INFINITY;
        for (let i = 0; i + 1 < parts.length; i++) {
          const rank = ranks.get(`${parts[i]} ${parts[i + 1]}`);
          if (rank !== undefined && rank < bestRank) [best, bestRank] = [i, rank];
        }
        if (best < 0) return parts.map((p) => json.model.vocab[p]);
        parts = [
          ...parts.slice(0, best),
          parts[best]! + parts[best + 1]!,
          ...parts.slice(best + 2),
        ];
      }
    };
    const letters = "theaosnrcdlgmpuw";
    let seed = 7;
    const random = () => {
      seed = (seed * 1103515245 + 12345) % 2 ** 31;
      return seed / 2 ** 31;
    };
    for (let k = 0; k < 300; k++) {
      const word = Array.from(
        { length: 1 + Math.floor(random() * 40) },
        () => letters[Math.floor(random() * letters.length)],
      ).join("");
      expect(tokenizer.encode(word, { allowSpecial: false }), word).toEqual(reference(word));
    }
    // The rescanning loop is quadratic in a pre-token's length (this took minutes); the queue is not.
    const long = "thecat".repeat(100_000 / 6);
    expect(tokenizer.decode(tokenizer.encode(long))).toBe(long);
  });
});
