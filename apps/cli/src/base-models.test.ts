import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  type HubStandin,
  shippedModelFiles,
  startHubStandin,
} from "@arbor/engine/test/hub-standin";
import { afterAll, beforeAll, beforeEach, describe, expect, it, vi } from "vitest";
import { pullBaseModel } from "./base-models.ts";
import { run } from "./commands.ts";

let hub: HubStandin;
let dataDir: string;
beforeAll(async () => {
  hub = await startHubStandin({
    repos: [
      { id: "acme/tiny-chat", refs: { main: shippedModelFiles() } },
      { id: "acme/gated", refs: { main: shippedModelFiles() }, gated: true },
      {
        id: "acme/pickled",
        refs: { main: { "config.json": "{}", "pytorch_model.bin": "pickle" } },
      },
    ],
  });
  dataDir = mkdtempSync(join(tmpdir(), "arbor-cli-pull-"));
});
afterAll(async () => {
  await hub?.close();
  rmSync(dataDir, { recursive: true, force: true });
});
beforeEach(() => {
  // The Hub as the command reads it: the stand-in, and no token from this machine's own setup.
  vi.stubEnv("HF_ENDPOINT", hub.endpoint);
  vi.stubEnv("HF_TOKEN", "");
  vi.stubEnv("HUGGING_FACE_HUB_TOKEN", "");
  vi.stubEnv("HF_TOKEN_PATH", join(dataDir, "no-token"));
  vi.stubEnv("ARBOR_DATA_DIR", dataDir);
  vi.stubEnv("ARBOR_BASE_MODELS_DIR", "");
  return () => vi.unstubAllEnvs();
});

function capture(tty: boolean) {
  const lines: string[] = [];
  const progress: string[] = [];
  return {
    lines,
    progress,
    io: {
      line: (t: string) => lines.push(t),
      write: (t: string) => lines.push(t),
      progress: { tty, write: (t: string) => progress.push(t) },
    },
  };
}

describe("arbor models pull", () => {
  it("when a repo is pulled, then stdout says its commit and what the engine made of it, stderr shows progress as lines, and the folder is under ARBOR_DATA_DIR/models", async () => {
    const { lines, progress, io } = capture(false);
    await run(["models", "pull", "acme/tiny-chat@main", "--id", "demo/tiny"], io);
    const commit = hub.commit("acme/tiny-chat");
    expect(lines).toEqual([
      `acme/tiny-chat@main is commit ${commit} on ${hub.endpoint}.`,
      "The engine can serve it (llama, 0.8M parameters): fetching model.safetensors (3.4 MB).",
      expect.stringMatching(
        new RegExp(
          `^Pulled acme/tiny-chat at ${commit} as demo/tiny \\(llama, 0\\.8M parameters, 4 files verified, 3\\.4 MB fetched\\) into .*demo/tiny\\.$`,
        ),
      ),
    ]);
    // Lines, not redraws: each ends in a newline, the last at 100%.
    expect(progress.every((p) => p.endsWith("\n") && !p.includes("\r"))).toBe(true);
    expect(progress.at(-1)).toMatch(/^\[#{24}\] 100% 3\.4 MB of 3\.4 MB {2}model\.safetensors\n$/);
    const manifest = JSON.parse(
      readFileSync(join(dataDir, "models", "demo", "tiny", "arbor-pull.json"), "utf8"),
    ) as { commit: string };
    expect(manifest.commit).toBe(commit);

    const again = capture(false);
    await run(["models", "pull", "acme/tiny-chat", "--id", "demo/tiny"], again.io);
    expect(again.lines.at(-1)).toMatch(/^demo\/tiny is already here, pulled from acme\/tiny-chat/);
  });

  it("when stderr is a terminal, then the bar is redrawn in place and ended with a newline", async () => {
    const { lines, progress, io } = capture(true);
    await pullBaseModel(
      {
        repo: "acme/tiny-chat",
        id: "demo/tty",
        modelsDir: join(dataDir, "models"),
        endpoint: hub.endpoint,
      },
      io,
    );
    expect(lines.at(-1)).toMatch(/^Pulled acme\/tiny-chat/);
    // Redraws, each line (the small files', then the weights') ended by a newline of its own.
    expect(progress.filter((p) => p !== "\n").length).toBeGreaterThan(1);
    expect(progress.every((p) => p === "\n" || (p.startsWith("\r") && p.endsWith("\x1b[K")))).toBe(
      true,
    );
    expect(progress.at(-2)).toMatch(/100% 3\.4 MB of 3\.4 MB {2}model\.safetensors/);
    expect(progress.at(-1)).toBe("\n");
  });

  it("when the repo is gated and HF_TOKEN is unset, or has only pickles, then the command fails saying why and leaves nothing", async () => {
    const { io } = capture(false);
    await expect(run(["models", "pull", "acme/gated"], io)).rejects.toThrow(
      /acme\/gated is gated .*accept its terms .*set HF_TOKEN/,
    );
    await expect(run(["models", "pull", "acme/pickled"], io)).rejects.toThrow(
      /only as pickles \(pytorch_model\.bin\)/,
    );
    await expect(run(["models", "pull"], io)).rejects.toThrow("REPO is required.");
    await expect(run(["models", "pull", "tiny-chat"], io)).rejects.toThrow(
      /repo id must be "<owner>\/<name>"/,
    );
    for (const id of ["acme/gated", "acme/pickled"])
      expect(existsSync(join(dataDir, "models", ...id.split("/")))).toBe(false);
  });
});
