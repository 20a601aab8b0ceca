/**
 * Long prompts on a long-context model: how long tokenizing takes as one word grows, and how
 * long an ordinary 5 KB chat takes to answer while such a word's prompt is being served.
 *
 * Usage: node bench/engine-long-prompts.ts [--lengths 1000,10000,30000,100000]
 *   [--textbook-max 30000] [--full]
 *
 * 1. Tokenizing: a chat of one word of n random lowercase letters rendered and tokenized as a
 *    request is (`ChatFormat.encode`) with each tokenizer the tests carry (Qwen3's, Llama 3's
 *    and tiny-chat's tokenizer.json, all through @huggingface/tokenizers), beside a textbook
 *    BPE that rescans the word for its best pair after every merge (quadratic in the word's
 *    length; over Llama 3's merges, up to `--textbook-max` letters). Best of 3, ms.
 * 2. A 9 MB document of lines, on a model with a 131,072-token context: tokenized whole (as
 *    before) and tokenized only until it passes the context (as the prompt encoder does now).
 * 3. Fairness: tiny-chat with a 131,072-token context on an engine thread (one kernel thread).
 *    The word's prompt is sent (max_tokens 1); once its prefill runs, a 5 KB chat (about 2,200
 *    tokens, max_tokens 4) is sent, and its time to the answer (tokenizing included) is taken.
 *    The long request is then cancelled, unless `--full`, which waits for it and reports its
 *    time too.
 */
import { rmSync } from "node:fs";
import { parseArgs } from "node:util";
import { catalogModelDir, readChatFiles } from "@arbor/engine/model";
import { EngineThread } from "@arbor/engine/serve";
import { bytesToSymbols } from "../packages/engine/scripts/bpe.ts";
import { ChatFormat, type ChatMessage } from "../packages/engine/src/model/chat.ts";
import type { TokenLimitError } from "../packages/engine/src/model/tokenizer.ts";
import { FAMILIES, familyChatFiles } from "../packages/engine/test/families.ts";
import { longContextTinyChat } from "../packages/engine/test/fixtures.ts";
import { printTable } from "./torch.ts";

const { values: args } = parseArgs({
  options: {
    lengths: { type: "string", default: "1000,10000,30000,100000" },
    "textbook-max": { type: "string", default: "30000" },
    full: { type: "boolean", default: false },
  },
});
const lengths = args.lengths.split(",").map(Number);
const textbookMax = Number(args["textbook-max"]);

/** n lowercase letters from a fixed LCG: one word, no spaces. */
function word(n: number): string {
  let seed = 7;
  let out = "";
  for (let i = 0; i < n; i++) {
    seed = (seed * 1103515245 + 12345) % 2 ** 31;
    out += String.fromCharCode(97 + (seed % 26));
  }
  return out;
}

function best(f: () => void, rounds = 3): number {
  let min = Number.POSITIVE_INFINITY;
  for (let r = 0; r < rounds; r++) {
    const t0 = performance.now();
    f();
    min = Math.min(min, performance.now() - t0);
  }
  return min;
}

/** The textbook loop: merge the lowest-ranked adjacent pair (leftmost among equals), rescanning
 * the whole word after each merge. */
function textbookBpe(text: string, ranks: Map<string, number>): number {
  let parts = [...bytesToSymbols(new TextEncoder().encode(text))];
  for (;;) {
    let at = -1;
    let bestRank = Number.POSITIVE_INFINITY;
    for (let i = 0; i + 1 < parts.length; i++) {
      const rank = ranks.get(`${parts[i]} ${parts[i + 1]}`);
      if (rank !== undefined && rank < bestRank) [at, bestRank] = [i, rank];
    }
    if (at < 0) return parts.length;
    parts = [...parts.slice(0, at), parts[at]! + parts[at + 1]!, ...parts.slice(at + 2)];
  }
}

const ask = (content: string): ChatMessage[] => [{ role: "user", content }];
const tinyFiles = await readChatFiles(catalogModelDir("arbor/tiny-chat"));
const formats: [string, ChatFormat][] = [
  ...FAMILIES.filter((f) => f.name !== "Llama 3.1").map((f): [string, ChatFormat] => [
    f.name,
    new ChatFormat(familyChatFiles(f), []),
  ]),
  ["tiny-chat", new ChatFormat(tinyFiles, [])],
];

const tokenizeRows: (string | number | null)[][] = [];
for (const [name, chat] of formats) {
  chat.encode(ask("warm up"), { addGenerationPrompt: true });
  const row: (string | number | null)[] = [`${name} (@huggingface/tokenizers)`];
  let perLetter = 0;
  for (const n of lengths) {
    const messages = ask(word(n));
    const ms = best(() => chat.encode(messages, { addGenerationPrompt: true }));
    row.push(ms);
    perLetter = (ms * 1000) / n;
  }
  tokenizeRows.push([...row, perLetter]);
}
const llama3 = formats.find(([name]) => name === "Llama 3")![1];
const ranks = new Map(llama3.tokenizer.merges().map((m, i) => [m, i] as const));
const textbook: (string | number | null)[] = ["textbook BPE, rescan per merge (Llama 3)"];
let textbookPerLetter: number | null = null;
for (const n of lengths) {
  if (n > textbookMax) {
    textbook.push(null);
    continue;
  }
  const text = word(n);
  const ms = best(() => textbookBpe(text, ranks), 1);
  textbook.push(ms);
  textbookPerLetter = (ms * 1000) / n;
}
tokenizeRows.push([...textbook, textbookPerLetter]);

console.log("\nRendering and tokenizing a chat of one n-letter word, ms (best of 3):\n");
printTable(
  [
    "tokenizer",
    ...lengths.map((n) => `${n.toLocaleString("en")} letters`),
    "µs / letter (longest)",
  ],
  tokenizeRows,
);

// A document that passes the byte bound of a 131,072-token context (its longest token being
// 256 bytes, up to 33 MB do) but takes far more tokens: all of it tokenized, as before, or
// tokenizing stopped at the context, as the prompt encoder does.
const line =
  'The quick brown fox jumps over the lazy dog. Numbers 1234567890 and 3.14159 follow; naïve café, 中文测试，你好世界 🙂 and JSON {"answer": 42}.\n';
const document = ask(line.repeat(Math.ceil(9e6 / Buffer.byteLength(line))));
const refusalRows: (string | number | null)[][] = [];
for (const [name, chat] of formats.filter(([name]) => name !== "tiny-chat")) {
  let tokens = 0;
  const all = best(() => {
    tokens = chat.encode(document, { addGenerationPrompt: true }).length;
  }, 1);
  let counted = 0;
  const limited = best(() => {
    try {
      chat.encode(document, { addGenerationPrompt: true, limit: 131_073 });
    } catch (err) {
      counted = (err as TokenLimitError).tokens;
    }
  });
  refusalRows.push([name, tokens, all, counted, limited]);
}
console.log("\nA 9 MB document on a model with a 131,072-token context, ms:\n");
printTable(
  [
    "tokenizer",
    "its tokens",
    "tokenize all of it (before)",
    "tokens counted",
    "stop past the context (now)",
  ],
  refusalRows,
);

// Fairness on an engine thread serving a 131,072-token context.
const dir = longContextTinyChat();
const thread = await EngineThread.start(dir, { threads: 1, weights: "f32" });
const short = ask("Hello there, how are you today? ".repeat(160));

async function answer(messages: ChatMessage[], maxTokens: number, signal?: AbortSignal) {
  const prompt = await thread.encodeChat(messages);
  for await (const event of thread.generate(
    { prompt, maxTokens, temperature: 0 },
    signal ? { signal } : {},
  ))
    if (event.type === "done") return prompt.length;
  return prompt.length;
}

const alone0 = performance.now();
const shortTokens = await answer(short, 4);
await answer(short, 4);
const aloneMs = performance.now() - alone0;
const fairRows: (string | number | null)[][] = [["none", "–", "–", aloneMs / 2, "–", "–"]];
for (const n of lengths) {
  const controller = new AbortController();
  const t0 = performance.now();
  let encodedMs = 0;
  let longTokens = 0;
  let longMs: number | null = null;
  const long = thread.encodeChat(ask(word(n))).then(async (prompt) => {
    encodedMs = performance.now() - t0;
    longTokens = prompt.length;
    for await (const _ of thread.generate(
      { prompt, maxTokens: 1, temperature: 0 },
      { signal: controller.signal },
    ));
    longMs = performance.now() - t0;
  });
  const settled = long.catch(() => {});
  // The short chat arrives once the long prompt is being prefilled.
  while ((await thread.stats()).activeSequences === 0 && longMs === null) {
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
  const s0 = performance.now();
  await answer(short, 4);
  const shortMs = performance.now() - s0;
  const firstDone = longMs === null ? "5 KB chat" : "long prompt";
  if (!args.full) controller.abort(new Error("cancelled"));
  await settled;
  fairRows.push([
    `${n.toLocaleString("en")} letters`,
    longTokens,
    encodedMs,
    shortMs,
    firstDone,
    longMs ?? "cancelled",
  ]);
  while ((await thread.stats()).activeSequences > 0) {
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
}
await thread.dispose();
rmSync(dir, { recursive: true, force: true });

console.log(
  `\nA 5 KB chat (${shortTokens} prompt tokens, 4 generated) while one word's prompt is served, tiny-chat with a 131,072-token context, one kernel thread:\n`,
);
printTable(
  [
    "long prompt",
    "its tokens",
    "its tokenize ms",
    "5 KB chat ms (tokenize + answer)",
    "answered first",
    "long prompt ms",
  ],
  fairRows,
);
