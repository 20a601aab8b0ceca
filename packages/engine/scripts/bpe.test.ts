import { describe, expect, it } from "vitest";
import { tinyTokenizer } from "../test/fixtures.ts";
import { renderChat } from "./chat.ts";
import { Tokenizer } from "./tokenizer.ts";

describe("Tokenizer", () => {
  const tokenizer = tinyTokenizer();

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

  it("when written to tokenizer.json and read back, then it encodes identically", () => {
    const json = JSON.parse(JSON.stringify(tokenizer.toJson()));
    expect(json.model.type).toBe("BPE");
    expect(json.pre_tokenizer.pretokenizers[1].type).toBe("ByteLevel");
    const again = Tokenizer.fromJson(json);
    const text = "The dog sat on 7 + 5 = 12. <|endoftext|>";
    expect(again.encode(text)).toEqual(tokenizer.encode(text));
    expect(again.vocabSize).toBe(tokenizer.vocabSize);
  });

  it("when a GPT-2 style tokenizer.json with string merges is read, then it applies them", () => {
    const vocab: Record<string, number> = { h: 0, e: 1, he: 2, Ġ: 3, Ġhe: 4 };
    const t = Tokenizer.fromJson({
      model: { type: "BPE", vocab, merges: ["h e", "Ġ he"] },
      added_tokens: [],
      pre_tokenizer: { type: "ByteLevel", add_prefix_space: false, use_regex: true },
    });
    expect(t.encode("he he")).toEqual([2, 4]);
  });

  it("when words are merged, then the ids equal a rescanning reference BPE's, and a 100,000-letter word still encodes", () => {
    const json = tokenizer.toJson() as { model: { vocab: Record<string, number> } };
    const ranks = new Map(tokenizer.merges.map(([a, b], i) => [`${a} ${b}`, i]));
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

describe("renderChat", () => {
  const tokenizer = tinyTokenizer();

  it("when a conversation is rendered, then it is ChatML and only assistant tokens are masked", () => {
    const chat = renderChat(
      tokenizer,
      [
        { role: "system", content: "Be brief." },
        { role: "developer", content: "Use JSON." },
        { role: "user", content: "Hi" },
        { role: "assistant", content: "Hello!" },
        { role: "tool", content: "42" },
      ],
      { addGenerationPrompt: true },
    );
    expect(chat.text).toBe(
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>developer\nUse JSON.<|im_end|>\n" +
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n" +
        "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n",
    );
    expect(tokenizer.decode(chat.tokens)).toBe(chat.text);
    const masked = chat.tokens.filter((_, i) => chat.assistantMask[i] === 1);
    expect(tokenizer.decode(masked)).toBe("Hello!<|im_end|>");
  });

  it("when an assistant message has tool calls, then they are rendered in tool_call tags", () => {
    const chat = renderChat(tokenizer, [
      { role: "assistant", content: "", toolCalls: [{ name: "add", arguments: '{"a":1}' }] },
    ]);
    expect(chat.text).toContain('<tool_call>\n{"name":"add","arguments":{"a":1}}\n</tool_call>');
  });
});
