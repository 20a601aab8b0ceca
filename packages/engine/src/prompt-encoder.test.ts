import { describe, expect, it } from "vitest";
import { tinyModel } from "../test/fixtures.ts";
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
});
