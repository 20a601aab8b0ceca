import { execFileSync, spawnSync } from "node:child_process";
import type { AddressInfo } from "node:net";
import { createServer } from "node:net";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";
import pkg from "../package.json" with { type: "json" };
import { COMMANDS, checkNode, run } from "./commands.ts";

function capture() {
  const lines: string[] = [];
  return { lines, io: { line: (t: string) => lines.push(t), write: (t: string) => lines.push(t) } };
}

describe("arbor's command line", () => {
  it("when a command gets an option that is not its own, then it is refused with that command's usage", async () => {
    const { io } = capture();
    await expect(run(["models", "create", "--epochs", "3"], io)).rejects.toThrow(
      /^Unknown option --epochs for "arbor models create"\.\n\nUsage: arbor models create --project P --name N/,
    );
  });

  it("when help names a command, then only its usage is shown; bare help lists every command", async () => {
    const one = capture();
    await run(["help", "train", "sft"], one.io);
    expect(one.lines.join("\n")).toMatch(
      /^arbor train sft --model MODEL --data[\s\S]*--lr-schedule S/,
    );
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
      /Unknown command "trian sft". Did you mean "arbor train sft"\?[\s\S]*arbor train sft/,
    );
  });

  it("when an option is misspelt, then the error suggests the right one", async () => {
    const { io } = capture();
    await expect(
      run(["train", "sft", "--model", "m", "--data", "d.jsonl", "--epoch", "3"], io),
    ).rejects.toThrow(/^Unknown option --epoch for "arbor train sft"\. Did you mean --epochs\?\n/);
    await expect(run(["chat", "m", "--temprature", "0"], io)).rejects.toThrow(
      /Did you mean --temperature\?/,
    );
  });

  it("when --version is asked, then it prints the version", async () => {
    const { io, lines } = capture();
    await run(["--version"], io);
    expect(lines).toEqual([`arbor ${pkg.version}`]);
  });

  it("when no server listens at the URL, then the error names the URL and how to change it", async () => {
    const { io } = capture();
    const saved = process.env.ARBOR_BASE_URL;
    // A port that was just free: nothing listens there.
    const probe = createServer();
    await new Promise<void>((r) => probe.listen(0, "127.0.0.1", r));
    const { port } = probe.address() as AddressInfo;
    await new Promise((r) => probe.close(r));
    process.env.ARBOR_BASE_URL = `http://127.0.0.1:${port}`;
    try {
      await expect(run(["models", "list"], io)).rejects.toThrow(
        new RegExp(
          `Could not reach the Arbor server at http://127\\.0\\.0\\.1:${port} \\(connect ECONNREFUSED .*\\).*ARBOR_BASE_URL`,
        ),
      );
    } finally {
      if (saved === undefined) delete process.env.ARBOR_BASE_URL;
      else process.env.ARBOR_BASE_URL = saved;
    }
  });

  it("when the bin runs, then it runs the bundle; on a Node older than 20, then it says which Node it needs", () => {
    const bin = fileURLToPath(new URL("../bin/arbor.js", import.meta.url));
    expect(execFileSync(process.execPath, [bin, "--version"], { encoding: "utf8" })).toBe(
      `arbor ${pkg.version}\n`,
    );
    // Node 18 as the bin sees it: no older Node is installed here to run it for real.
    const node18 = `data:text/javascript,Object.defineProperty(process,"versions",{value:{...process.versions,node:"18.20.0"}})`;
    const result = spawnSync(process.execPath, ["--import", node18, bin, "--version"], {
      encoding: "utf8",
    });
    expect(result.status).toBe(1);
    expect(result.stdout).toBe("");
    expect(result.stderr).toBe(
      `arbor: this command needs Node 20 or later; this is Node 18.20.0 (${process.execPath}).\n`,
    );
  });

  it("when a store command meets a Node older than 24, then one line names the Node it needs; server commands need none", () => {
    const needing = COMMANDS.filter((c) => c.needs).map((c) => c.name);
    expect(needing).toEqual([
      "keys create",
      "keys list",
      "keys revoke",
      "prices set",
      "prices list",
      "prices delete",
      "blobs import",
    ]);
    const keys = COMMANDS.find((c) => c.name === "keys list")!;
    expect(() => checkNode(keys, "20.20.2")).toThrow(
      /^"arbor keys list" needs Node 24 or later \(it opens the Arbor store with node:sqlite\); this is Node 20\.20\.2\. [^\n]+$/,
    );
    expect(() => checkNode(keys, "22.12.0")).toThrow(/needs Node 24 or later/);
    expect(() => checkNode(keys, "24.0.0")).not.toThrow();
    for (const c of COMMANDS.filter((c) => !c.needs))
      expect(() => checkNode(c, "20.0.0")).not.toThrow();
  });
});
