import { describe, expect, it } from "vitest";
import { batchFromChats } from "./batch.ts";
import { tinyTokenizer } from "./test-fixtures.ts";

describe("batchFromChats", () => {
  it("when chats are batched, then only assistant targets carry loss and rows are padded", () => {
    const tokenizer = tinyTokenizer();
    const pad = tokenizer.tokenId("<|endoftext|>")!;
    const batch = batchFromChats(
      tokenizer,
      [
        [
          { role: "user", content: "Hi" },
          { role: "assistant", content: "Hello!" },
        ],
        [{ role: "user", content: "The cat sat on the mat. The dog sat on the log." }],
      ],
      { seqLen: 40, padToken: pad },
    );
    expect(batch.batchSize).toBe(2);
    const trained: number[] = [];
    for (let t = 0; t < 40; t++) if (batch.lossMask[t] === 1) trained.push(batch.targets[t]!);
    expect(tokenizer.decode(trained)).toBe("Hello!<|im_end|>");
    expect(batch.lossMask.subarray(40).every((m) => m === 0)).toBe(true);
    expect(batch.inputs[39]).toBe(pad);
    expect(batch.lossMask[39]).toBe(0);
    expect(batch.targets[0]).toBe(batch.inputs[1]);
  });
});
