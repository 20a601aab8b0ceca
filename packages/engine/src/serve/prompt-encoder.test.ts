import { Tokenizer as HfTokenizer } from "@huggingface/tokenizers";
import { describe, expect, it, vi } from "vitest";
import { FAMILIES, familyChatFiles } from "../../test/families.ts";
import { tinyModel } from "../../test/fixtures.ts";
import { ChatFormat } from "../model/chat.ts";
import { TEXT_PIECE_CHARS } from "../model/tokenizer.ts";
import { ContextLengthError, PromptEncoder } from "./prompt-encoder.ts";

describe("PromptEncoder", () => {
  const { chat } = tinyModel();
  const messages = (text: string) => [
    { role: "system" as const, content: "Be brief." },
    { role: "user" as const, content: text },
  ];

  it("when a prompt is large or long, then its worker thread gives exactly the inline tokens", async () => {
    const encoder = new PromptEncoder(chat, { inlineBytes: 16, longBytes: 4096 });
    try {
      for (const repeat of [20, 200]) {
        const text = "The cat sat on the mat. 7 + 5 = 12. Héllo 🙂 ".repeat(repeat);
        const tokens = await encoder.encodeChat(messages(text));
        expect(tokens).toEqual(chat.encode(messages(text), { addGenerationPrompt: true }));
      }
    } finally {
      await encoder.dispose();
    }
  });

  it("when a long prompt is being tokenized, then a shorter one sent after it is answered first", async () => {
    const encoder = new PromptEncoder(chat, { inlineBytes: 16 });
    try {
      const short = messages("Hello there, how are you today? ".repeat(160));
      await encoder.encodeChat(short);
      const order: string[] = [];
      const long = encoder
        .encodeChat(messages("The cat sat on the mat. 7 + 5 = 12. ".repeat(30_000)))
        .then(() => order.push("long"));
      const again = encoder.encodeChat(short).then(() => order.push("short"));
      await Promise.all([long, again]);
      expect(order).toEqual(["short", "long"]);
    } finally {
      await encoder.dispose();
    }
  });

  it("when a prompt's bytes alone exceed what the context can hold, then it is refused before tokenizing", async () => {
    const encoder = new PromptEncoder(chat, { inlineBytes: 16 });
    const text = "a".repeat(encoder.maxTokenBytes * 100);
    const refusal = await encoder
      .encodeChat(messages(text), { contextLength: 100 })
      .catch((e) => e);
    expect(refusal).toBeInstanceOf(ContextLengthError);
    expect(refusal).toMatchObject({ exact: false, context: 100 });
    // Refused from the length alone: no thread was started for it.
    await encoder.dispose();
  });

  it("when a prompt tokenizes to the whole context, then the refusal gives its exact length", async () => {
    const encoder = new PromptEncoder(chat);
    const exact = chat.encode(messages("hello there"), { addGenerationPrompt: true }).length;
    const refusal = await encoder
      .encodeChat(messages("hello there"), { contextLength: exact })
      .catch((e) => e);
    expect(refusal).toMatchObject({ exact: true, tokens: exact, context: exact });
    expect(
      await encoder.encodeChat(messages("hello there"), { contextLength: exact + 1 }),
    ).toHaveLength(exact);
  });

  it("when a document passes the byte bound but not the context, then it is refused after a context's worth of tokenizing", async () => {
    // Llama 3's longest token is 256 bytes: 1.5 MB may be as few as 6,000 tokens.
    const llama = new ChatFormat(familyChatFiles(FAMILIES[1]), []);
    const document = messages("The cat sat on the mat. 7 + 5 = 12. Héllo 🙂\n".repeat(35_000));
    const inline = new PromptEncoder(llama, { inlineBytes: Number.POSITIVE_INFINITY });
    const encode = vi.spyOn(HfTokenizer.prototype, "encode");
    try {
      const refusal = await inline.encodeChat(document, { contextLength: 8192 }).catch((e) => e);
      expect(refusal).toBeInstanceOf(ContextLengthError);
      expect(refusal).toMatchObject({ exact: false, context: 8192 });
      expect(refusal.tokens).toBeGreaterThan(8192);
      const read = encode.mock.calls.reduce(
        (n: number, call: unknown[]) => n + String(call[0]).length,
        0,
      );
      expect(read).toBeLessThan(2 * TEXT_PIECE_CHARS);
    } finally {
      encode.mockRestore();
    }
    const threaded = new PromptEncoder(llama);
    try {
      const refusal = await threaded.encodeChat(document, { contextLength: 8192 }).catch((e) => e);
      expect(refusal).toBeInstanceOf(ContextLengthError);
      expect(refusal).toMatchObject({ exact: false, context: 8192 });
    } finally {
      await threaded.dispose();
    }
  });
});
