import { readFileSync } from "node:fs";
import { join, resolve } from "node:path";
import { run } from "@arbor/cli/commands";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/**
 * The README's CLI flow, run as written (its `./scripts/arbor` lines, in order, from the
 * repository root) against a live server: the chat after training answers differently from
 * the one before, in the format the examples teach.
 */
const root = resolve(import.meta.dirname, "../../..");
let server: RunningServer;
const saved = { ...process.env };
const cwd = process.cwd();

beforeAll(async () => {
  server = await startServer({}, { worker: true });
  process.env.ARBOR_BASE_URL = server.baseUrl;
  process.env.ARBOR_API_KEY = server.adminKey;
  process.chdir(root);
});
afterAll(async () => {
  process.chdir(cwd);
  for (const k of ["ARBOR_BASE_URL", "ARBOR_API_KEY"]) {
    if (saved[k] === undefined) delete process.env[k];
    else process.env[k] = saved[k];
  }
  await server.close();
});

/** The `./scripts/arbor` commands of the README's first bash block that has any, continuation
 * lines joined. */
function readmeCommands(): string[][] {
  const readme = readFileSync(join(root, "README.md"), "utf8");
  const block =
    [...readme.matchAll(/```bash\n([\s\S]*?)```/g)]
      .map((m) => m[1]!)
      .find((b) => b.includes("./scripts/arbor ")) ?? "";
  return block
    .replace(/\\\n\s*/g, " ")
    .split("\n")
    .map((line) => line.replace(/\s+#.*$/, "").trim())
    .filter((line) => line.startsWith("./scripts/arbor "))
    .map((line) => words(line.slice("./scripts/arbor ".length)));
}

/** Shell words: spaces split, double quotes group. */
function words(line: string): string[] {
  return [...line.matchAll(/"([^"]*)"|(\S+)/g)].map((m) => m[1] ?? m[2]!);
}

describe("the README's CLI flow", () => {
  it("when run as written, then training visibly changes the answer", async () => {
    const commands = readmeCommands();
    expect(commands.map((c) => c.slice(0, 2).join(" "))).toEqual([
      "models create",
      "chat default/demo/json",
      "train sft",
      "chat default/demo/json",
    ]);
    const answers: string[] = [];
    for (const args of commands) {
      let out = "";
      await run(args, {
        line: (t) => {
          out += `${t}\n`;
        },
        write: (t) => {
          out += t;
        },
      });
      if (args[0] === "chat") answers.push(out.trim());
      if (args[0] === "train") expect(out).toMatch(/Training ended\./);
    }
    const [before, after] = answers;
    expect(after).not.toBe(before);
    expect(after).toBe('{"answer": 5}');

    // Not only greedily: sampled at the console playground's temperature, the trained model
    // keeps the format it was shown.
    const client = server.authorizedClient();
    const samples = await Promise.all(
      Array.from({ length: 20 }, (_, seed) =>
        client.chat.completions.create({
          model: "default/demo/json",
          messages: [{ role: "user", content: "What is 2 + 3? Answer in JSON." }],
          temperature: 0.7,
          seed,
          max_tokens: 16,
        }),
      ),
    );
    const texts = samples.map((c) => c.choices[0]!.message.content ?? "");
    const valid = texts.filter((t) => {
      try {
        const parsed = JSON.parse(t) as unknown;
        return (
          typeof parsed === "object" &&
          parsed !== null &&
          Object.keys(parsed).join() === "answer" &&
          Number.isInteger((parsed as { answer: unknown }).answer)
        );
      } catch {
        return false;
      }
    });
    expect(valid.length, texts.join(" | ")).toBeGreaterThanOrEqual(18);
  });
});
