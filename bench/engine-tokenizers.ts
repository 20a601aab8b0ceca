/**
 * Tokenizers and chat templates: encoding throughput (MB/s) of Qwen3's, Llama 3's and
 * tiny-chat's tokenizer.json through @huggingface/tokenizers, beside the hand-written BPE that
 * tiny-chat used before; the time to render and tokenize one chat request; and tokenizing's share
 * of a tiny-chat request's engine time.
 * Usage: node bench/engine-tokenizers.ts
 */
import { catalogModelDir, loadModel } from "@arbor/engine/model";
import { Engine } from "@arbor/engine/serve";
import { BpeTokenizer } from "../packages/engine/scripts/bpe.ts";
import { ChatFormat, type ChatMessage } from "../packages/engine/src/model/chat.ts";
import { FAMILIES, familyChatFiles } from "../packages/engine/test/families.ts";
import { printTable } from "./torch.ts";

const text = [
  "The quick brown fox jumps over the lazy dog. Numbers 1234567890 and 3.14159 follow; ",
  "Unicode: naïve café, 中文测试，你好世界, emoji 🙂👍🏽, code `const x = f(a, b);` ",
  'and JSON {"answer": 42, "ok": true}.\n\n',
]
  .join("")
  .repeat(2000);
const megabytes = Buffer.byteLength(text) / 1e6;

/** Best of `rounds` timings of `f`, in ms. */
function best(f: () => void, rounds = 5): number {
  let min = Number.POSITIVE_INFINITY;
  for (let r = 0; r < rounds; r++) {
    const t0 = performance.now();
    f();
    min = Math.min(min, performance.now() - t0);
  }
  return min;
}

const conversation: ChatMessage[] = [
  { role: "system", content: "You are a concise assistant. Answer in one sentence." },
  { role: "user", content: "What is the capital of Norway, and what is it known for?" },
  { role: "assistant", content: "Oslo: its fjord, the Opera House and the Munch Museum." },
  { role: "user", content: "And how many people live there, roughly, as of the last census?" },
];

const tiny = await loadModel(catalogModelDir("arbor/tiny-chat"));
const formats: [string, ChatFormat][] = [
  ...FAMILIES.filter((f) => f.name !== "Llama 3.1").map((f): [string, ChatFormat] => [
    f.name,
    new ChatFormat(familyChatFiles(f), []),
  ]),
  ["tiny-chat", tiny.chat],
];

const rows: (string | number)[][] = [];
for (const [name, chat] of formats) {
  const ms = best(() => chat.tokenizer.encode(text, { special: false }), 3);
  const render = best(() => {
    for (let i = 0; i < 100; i++) chat.template.render(conversation, { addGenerationPrompt: true });
  });
  const request = best(() => {
    for (let i = 0; i < 100; i++) chat.encode(conversation, { addGenerationPrompt: true });
  });
  rows.push([
    `${name} (@huggingface/tokenizers)`,
    megabytes / (ms / 1000),
    render / 100,
    request / 100,
  ]);
}
const handWritten = BpeTokenizer.fromJson(tiny.tokenizer.files.tokenizer);
const legacyMs = best(() => handWritten.encode(text, { allowSpecial: false }), 3);
rows.push(["tiny-chat (hand-written BPE, before)", megabytes / (legacyMs / 1000), "–", "–"]);

console.log(`\nEncoding ${megabytes.toFixed(1)} MB of mixed text; a 4-message chat request:\n`);
printTable(
  ["tokenizer", "encode MB/s", "render ms / request", "render + tokenize ms / request"],
  rows,
);

// A tiny-chat request as the engine serves it: the prompt tokenized, then prefilled and 16 tokens
// decoded. tiny-chat's context is 256 tokens, so its longest prompt is used (about 240 tokens).
const engine = new Engine(tiny);
const filler = "Reverse the word apple, then uppercase horse, then spell cat. ";
let long: ChatMessage[] = [{ role: "user", content: filler }];
while (tiny.chat.encode(long, { addGenerationPrompt: true }).length < 230) {
  long = [{ role: "user", content: long[0]!.content + filler }];
}
const promptTokens = tiny.chat.encode(long, { addGenerationPrompt: true }).length;
const tokenizeMs =
  best(() => {
    for (let i = 0; i < 100; i++) tiny.chat.encode(long, { addGenerationPrompt: true });
  }) / 100;
await engine.complete({ messages: long, maxTokens: 16, temperature: 0 });
let requestMs = Number.POSITIVE_INFINITY;
for (let r = 0; r < 5; r++) {
  const t0 = performance.now();
  await engine.complete({ messages: long, maxTokens: 16, temperature: 0 });
  requestMs = Math.min(requestMs, performance.now() - t0);
}
const fiveHundred = [{ role: "user" as const, content: filler.repeat(25) }];
const fiveHundredTokens = tiny.chat.encode(fiveHundred, { addGenerationPrompt: true }).length;
const fiveHundredMs =
  best(() => {
    for (let i = 0; i < 100; i++) tiny.chat.encode(fiveHundred, { addGenerationPrompt: true });
  }) / 100;
console.log("\nTokenizing's share of a tiny-chat request (engine in-process, one thread):\n");
printTable(
  ["prompt", "tokenize ms", "request ms (tokenize + prefill + 16 tokens)", "share"],
  [
    [
      `${promptTokens} tokens`,
      tokenizeMs,
      requestMs,
      `${((tokenizeMs / requestMs) * 100).toFixed(1)} %`,
    ],
    [
      `${fiveHundredTokens} tokens (over tiny-chat's context)`,
      fiveHundredMs,
      "–",
      `${((fiveHundredMs / requestMs) * 100).toFixed(1)} % of the above`,
    ],
  ],
);
