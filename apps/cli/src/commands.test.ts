import { describe, expect, it } from "vitest";
import { COMMANDS, run } from "./commands.ts";

function capture() {
  const lines: string[] = [];
  return { lines, io: { line: (t: string) => lines.push(t), write: (t: string) => lines.push(t) } };
}

describe("arbor's command line", () => {
  it("when a command gets an option that is not its own, then it is refused with that command's usage", async () => {
    const { io } = capture();
    await expect(run(["models", "create", "--epochs", "3"], io)).rejects.toThrow(
      /Unknown option '--epochs'[\s\S]*Usage: arbor models create --project P --name N/,
    );
  });

  it("when help names a command, then only its usage is shown; bare help lists every command", async () => {
    const one = capture();
    await run(["help", "train", "sft"], one.io);
    expect(one.lines.join("\n")).toMatch(/^arbor train sft --model MODEL_ID --data/);
    const flagged = capture();
    await run(["chat", "--help"], flagged.io);
    expect(flagged.lines.join("\n")).toMatch(/^arbor chat MODEL/);
    const all = capture();
    await run(["help"], all.io);
    for (const c of COMMANDS) expect(all.lines.join("\n")).toContain(`arbor ${c.name} `);
  });

  it("when a required argument is missing or a number is not one, then the error names it", async () => {
    const { io } = capture();
    await expect(run(["jobs", "get"], io)).rejects.toThrow("JOB_ID is required.");
    await expect(
      run(["prices", "set", "--model", "m", "--prompt", "x", "--completion", "1"], io),
    ).rejects.toThrow('--prompt must be a non-negative number, got "x".');
  });

  it("when the command is unknown, then the error lists the commands", async () => {
    const { io } = capture();
    await expect(run(["trian", "sft"], io)).rejects.toThrow(
      /Unknown command "trian sft"[\s\S]*arbor train sft/,
    );
  });
});
