import { mkdtemp, readFile, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { catalogModelDir } from "./catalog.ts";
import type { ChatMessage } from "./chat.ts";
import { loadModel, saveModel } from "./model.ts";
import { ModelFileError } from "./tokenizer.ts";

const messages: ChatMessage[] = [
  { role: "system", content: "Be brief." },
  { role: "user", content: "What is 2 + 2?" },
];

describe("loadModel / saveModel", () => {
  it("when a model folder is saved and read back, then its tokenizer, chat template and stop tokens are the same", async () => {
    const original = await loadModel(catalogModelDir("arbor/tiny-chat"));
    const dir = await mkdtemp(join(tmpdir(), "arbor-model-"));
    await saveModel(original, dir);
    const model = await loadModel(dir);
    expect(JSON.parse(await readFile(join(dir, "tokenizer.json"), "utf8"))).toEqual(
      original.tokenizer.files.tokenizer,
    );
    expect(model.chat.template.source).toBe(original.chat.template.source);
    expect([...model.chat.stopIds]).toEqual([...original.chat.stopIds]);
    expect(model.chat.encode(messages, { addGenerationPrompt: true })).toEqual(
      original.chat.encode(messages, { addGenerationPrompt: true }),
    );
  });

  it("when chat_template.jinja sits beside tokenizer_config.json, then it is the template", async () => {
    const dir = await mkdtemp(join(tmpdir(), "arbor-model-"));
    await saveModel(await loadModel(catalogModelDir("arbor/tiny-chat")), dir);
    await writeFile(
      join(dir, "chat_template.jinja"),
      "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}",
    );
    const model = await loadModel(dir);
    expect(model.chat.template.render(messages)).toBe(
      "[system] Be brief.\n[user] What is 2 + 2?\n",
    );
  });

  it("when generation_config.json sets sampling defaults and end ids, then the model has them", async () => {
    const dir = await mkdtemp(join(tmpdir(), "arbor-model-"));
    await saveModel(await loadModel(catalogModelDir("arbor/tiny-chat")), dir);
    await writeFile(
      join(dir, "generation_config.json"),
      JSON.stringify({ eos_token_id: [765, 7], temperature: 0.6, top_k: 20, top_p: 0.95 }),
    );
    const model = await loadModel(dir);
    expect(model.generation).toMatchObject({ temperature: 0.6, topK: 20, topP: 0.95 });
    expect(model.chat.stopIds).toContain(7);
    await writeFile(join(dir, "generation_config.json"), '{"do_sample": false}');
    expect((await loadModel(dir)).generation.temperature).toBe(0);
    expect(model.chat.stopIds).toContain(model.tokenizer.tokenId("<|im_end|>"));
  });

  it("when a file is missing or not JSON, or the template does not parse, then the error names the file", async () => {
    const dir = await mkdtemp(join(tmpdir(), "arbor-model-"));
    await saveModel(await loadModel(catalogModelDir("arbor/tiny-chat")), dir);
    await writeFile(join(dir, "tokenizer.json"), "{ not json");
    await expect(loadModel(dir)).rejects.toThrow(ModelFileError);
    await expect(loadModel(dir)).rejects.toThrow(`${join(dir, "tokenizer.json")}: not valid JSON`);
    const other = await mkdtemp(join(tmpdir(), "arbor-model-"));
    await saveModel(await loadModel(catalogModelDir("arbor/tiny-chat")), other);
    await writeFile(join(other, "chat_template.jinja"), "{% for %}");
    await expect(loadModel(other)).rejects.toThrow(
      `${join(other, "chat_template.jinja")}: the chat template does not parse`,
    );
  });
});
