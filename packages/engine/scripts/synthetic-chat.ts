import type { ChatMessage } from "../src/model/chat.ts";
import type { Rng } from "../src/model/rng.ts";

/**
 * Synthetic ChatML dialogues in a deliberately narrow domain: small-number arithmetic, simple
 * word transforms, greetings, yes/no facts and short formatted answers. Word reversal and JSON
 * answers are held out of pretraining so that fine-tuning on them shows a clear rise.
 */

export const WORDS = {
  animal: [
    "cat",
    "dog",
    "bird",
    "fish",
    "horse",
    "cow",
    "pig",
    "duck",
    "lion",
    "bear",
    "frog",
    "mouse",
    "goat",
    "sheep",
    "wolf",
    "fox",
  ],
  fruit: [
    "apple",
    "banana",
    "pear",
    "grape",
    "lemon",
    "mango",
    "peach",
    "plum",
    "cherry",
    "melon",
    "orange",
    "kiwi",
  ],
  color: ["red", "blue", "green", "yellow", "black", "white", "pink", "brown", "purple", "gray"],
  thing: [
    "book",
    "chair",
    "table",
    "cup",
    "pen",
    "door",
    "lamp",
    "shoe",
    "hat",
    "ball",
    "box",
    "key",
    "car",
    "boat",
    "tree",
    "house",
    "phone",
    "clock",
  ],
} as const;

type Category = keyof typeof WORDS;
const categories = Object.keys(WORDS) as Category[];
const categoryNoun: Record<Category, string> = {
  animal: "an animal",
  fruit: "a fruit",
  color: "a color",
  thing: "a thing",
};
const allWords = categories.flatMap((c) => [...WORDS[c]]);
const numberWords = [
  "zero",
  "one",
  "two",
  "three",
  "four",
  "five",
  "six",
  "seven",
  "eight",
  "nine",
  "ten",
];

const systems = [
  "You are a helpful assistant.",
  "You are a friendly assistant. Keep answers short.",
  "You are Arbor, a small helpful model.",
];

function article(word: string): string {
  return /^[aeiou]/.test(word) ? `an ${word}` : `a ${word}`;
}

function arithmetic(rng: Rng): [string, string] {
  const a = rng.int(21);
  const b = rng.int(21);
  const kind = rng.int(3);
  if (kind === 0) {
    const q = rng.pick([
      `What is ${a} + ${b}?`,
      `Add ${a} and ${b}.`,
      `What is ${a} plus ${b}?`,
      `Compute ${a} + ${b}.`,
    ]);
    return [q, `${a} + ${b} = ${a + b}.`];
  }
  if (kind === 1) {
    const [x, y] = a >= b ? [a, b] : [b, a];
    const q = rng.pick([
      `What is ${x} - ${y}?`,
      `Subtract ${y} from ${x}.`,
      `What is ${x} minus ${y}?`,
    ]);
    return [q, `${x} - ${y} = ${x - y}.`];
  }
  const x = rng.int(11);
  const y = rng.int(11);
  const q = rng.pick([
    `What is ${x} * ${y}?`,
    `What is ${x} times ${y}?`,
    `Multiply ${x} by ${y}.`,
  ]);
  return [q, `${x} * ${y} = ${x * y}.`];
}

function transform(rng: Rng): [string, string] {
  const word = rng.pick(allWords);
  switch (rng.int(6)) {
    case 0:
      return [
        rng.pick([
          `Uppercase the word ${word}.`,
          `Write ${word} in capital letters.`,
          `Make ${word} uppercase.`,
        ]),
        word.toUpperCase(),
      ];
    case 1: {
      const n = 2 + rng.int(3);
      return [`Repeat the word ${word} ${n} times.`, Array(n).fill(word).join(" ")];
    }
    case 2:
      return [`What is the first letter of ${word}?`, `The first letter of ${word} is ${word[0]}.`];
    case 3:
      return [
        `What is the last letter of ${word}?`,
        `The last letter of ${word} is ${word.at(-1)}.`,
      ];
    case 4:
      return [`How many letters are in ${word}?`, `${word} has ${word.length} letters.`];
    default:
      return [`Spell ${word}.`, [...word].join("-")];
  }
}

function greeting(rng: Rng): [string, string] {
  return rng.pick<[string, string]>([
    ["Hello!", "Hello! How can I help you today?"],
    ["Hi", "Hi! What can I do for you?"],
    ["Good morning!", "Good morning! How can I help?"],
    ["Thanks!", "You're welcome!"],
    ["Thank you.", "You're welcome! Anything else?"],
    ["How are you?", "I am fine, thank you. How can I help?"],
    ["Who are you?", "I am a small assistant. I can do simple math and word games."],
    ["Bye!", "Goodbye! Have a nice day."],
    ["What can you do?", "I can add numbers, spell words and answer simple questions."],
  ]);
}

function fact(rng: Rng): [string, string] {
  const kind = rng.int(3);
  if (kind === 0) {
    const category = rng.pick(categories);
    const truth = rng.next() < 0.5;
    const wordCategory = truth ? category : rng.pick(categories.filter((c) => c !== category));
    const word = rng.pick(WORDS[wordCategory]);
    const q = `Is ${article(word)} ${categoryNoun[category]}?`;
    return [
      q,
      truth
        ? `Yes, ${article(word)} is ${categoryNoun[category]}.`
        : `No, ${article(word)} is ${categoryNoun[wordCategory]}.`,
    ];
  }
  if (kind === 1) {
    const a = rng.int(21);
    const b = rng.int(21);
    if (a === b) return [`Is ${a} equal to ${b}?`, `Yes, ${a} is equal to ${b}.`];
    return [
      `Is ${a} greater than ${b}?`,
      a > b ? `Yes, ${a} is greater than ${b}.` : `No, ${a} is less than ${b}.`,
    ];
  }
  const n = rng.int(21);
  return [`Is ${n} even or odd?`, `${n} is ${n % 2 === 0 ? "even" : "odd"}.`];
}

function formatted(rng: Rng): [string, string] {
  const category = rng.pick(categories);
  const kind = rng.int(3);
  if (kind === 0) {
    const n = 2 + rng.int(3);
    const items = shuffled(rng, [...WORDS[category]]).slice(0, n);
    const plural = category === "thing" ? "things" : `${category}s`;
    return [`List ${numberWords[n]} ${plural}.`, items.map((w, i) => `${i + 1}. ${w}`).join("\n")];
  }
  if (kind === 1) {
    const n = 1 + rng.int(9);
    return [`Write the number ${n} as a word.`, `${n} is ${numberWords[n]}.`];
  }
  const start = rng.int(10);
  const n = 3 + rng.int(3);
  const seq = Array.from({ length: n }, (_, i) => start + i);
  return [`Count from ${start} to ${start + n - 1}.`, seq.join(", ")];
}

function shuffled<T>(rng: Rng, items: T[]): T[] {
  for (let i = items.length - 1; i > 0; i--) {
    const j = rng.int(i + 1);
    [items[i], items[j]] = [items[j]!, items[i]!];
  }
  return items;
}

const generators = [arithmetic, arithmetic, transform, transform, greeting, fact, fact, formatted];

/** One pretraining dialogue: an optional system prompt and one to three exchanges. */
export function syntheticDialogue(rng: Rng): ChatMessage[] {
  const messages: ChatMessage[] = [];
  if (rng.next() < 0.4) messages.push({ role: "system", content: rng.pick(systems) });
  const turns = 1 + (rng.next() < 0.3 ? 1 + rng.int(2) : 0);
  for (let t = 0; t < turns; t++) {
    const [question, answer] = rng.pick(generators)(rng);
    messages.push({ role: "user", content: question }, { role: "assistant", content: answer });
  }
  return messages;
}

/** Held-out task: word reversal (not in pretraining). */
export function reversalExample(rng: Rng): [string, string] {
  const word = rng.pick(allWords);
  return [`Reverse the word ${word}.`, [...word].reverse().join("")];
}

/** Held-out task: arithmetic answered as a fixed JSON object (not in pretraining). */
export function jsonAnswerExample(rng: Rng): [string, string] {
  const a = rng.int(21);
  const b = rng.int(21);
  return [`What is ${a} + ${b}? Answer in JSON.`, JSON.stringify({ answer: a + b })];
}
