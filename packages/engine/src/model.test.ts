import { mkdtemp, readFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Template } from "@huggingface/jinja";
import { Tokenizer as HfTokenizer } from "@huggingface/tokenizers";
import { describe, expect, it } from "vitest";
import { catalogModelDir } from "./catalog.ts";
import { type ChatMessage, renderChat } from "./chat.ts";
import { loadModel, saveModel } from "./model.ts";

// Hugging Face's own JS tokenizer and Jinja implementations, as independent readers of our files.
describe("Hugging Face compatibility of a saved model folder", async () => {
  const dir = await mkdtemp(join(tmpdir(), "arbor-hf-"));
  await saveModel(await loadModel(catalogModelDir("arbor/tiny-chat")), dir);
  const model = await loadModel(dir);
  const tokenizerJson = JSON.parse(await readFile(join(dir, "tokenizer.json"), "utf8"));
  const tokenizerConfig = JSON.parse(await readFile(join(dir, "tokenizer_config.json"), "utf8"));
  const hf = new HfTokenizer(tokenizerJson, tokenizerConfig);

  it("when texts are encoded by tokenizers.js, then the ids equal ours", () => {
    const texts = [
      "What is 17 + 25? 17 + 25 = 42.",
      "<|im_start|>user\nUppercase the word horse.<|im_end|>\n<|im_start|>assistant\nHORSE<|im_end|>\n",
      "Héllo   wörld!\n\n  spaces\ttabs 🙂 don't it's",
      '{"answer": 12, "ok": true}',
    ];
    for (const text of texts) {
      expect(hf.encode(text).ids, text).toEqual(model.tokenizer.encode(text));
      expect(hf.decode(model.tokenizer.encode(text))).toBe(text);
    }
  });

  it("when the chat template is rendered by Jinja, then it equals renderChat", () => {
    const messages: ChatMessage[] = [
      { role: "system", content: "You are a helpful assistant." },
      { role: "user", content: "What is 2 + 2?" },
      { role: "assistant", content: "2 + 2 = 4." },
      { role: "user", content: "Thanks!" },
    ];
    const rendered = new Template(tokenizerConfig.chat_template).render({
      messages,
      add_generation_prompt: true,
    });
    expect(rendered).toBe(
      renderChat(model.tokenizer, messages, { addGenerationPrompt: true }).text,
    );
    expect(tokenizerConfig.eos_token).toBe("<|im_end|>");
  });
});
