import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import * as remote from "@arbor/cli/remote";
import { readAdapterTar } from "@arbor/training";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/** The `arbor` command's remote commands, against a real server. */
let server: RunningServer;
const dir = mkdtempSync(join(tmpdir(), "arbor-cli-"));
beforeAll(async () => {
  server = await startServer({}, { worker: true });
});
afterAll(async () => {
  await server.close();
  rmSync(dir, { recursive: true, force: true });
});

function capture() {
  const lines: string[] = [];
  const bars: string[] = [];
  return {
    lines,
    bars,
    out: { line: (t: string) => lines.push(t), bar: (t: string) => bars.push(t) },
  };
}

describe("arbor CLI", () => {
  it("when a model is trained with --follow, then it draws a progress bar with the loss, lists checkpoints and chats", async () => {
    const client = server.authorizedClient();
    const file = join(dir, "data.jsonl");
    writeFileSync(
      file,
      ["cat", "dog", "sun", "map"]
        .map((w) =>
          JSON.stringify({
            messages: [
              { role: "user", content: `Reverse the word ${w}.` },
              { role: "assistant", content: [...w].reverse().join("") },
            ],
          }),
        )
        .join("\n"),
    );
    const { lines, bars, out } = capture();
    const modelId = await remote.createModel(
      client,
      { project: "cli", name: "reverser", base: "arbor/tiny-chat" },
      out,
    );
    const jobId = await remote.trainSft(
      client,
      { model: modelId, data: file, epochs: 2, batchSize: 2 },
      out,
    );
    const last = await remote.followJob(client, { job: jobId }, out);
    expect(last?.type).toBe("training_ended");
    expect(lines[1]).toMatch(/^Uploaded 4 lines \(\d+ bytes\): dataset:\/\//);
    expect(lines).toContain("Training started: 4 steps.");
    expect(bars).toHaveLength(4);
    expect(bars[3]).toMatch(/^\[#{24}\] step 4\/4 {2}loss \d+\.\d{4}$/);
    expect(lines.at(-1)).toBe("Training ended.");

    const listed = capture();
    await remote.listCheckpoints(client, { model: modelId }, listed.out);
    expect(listed.lines.slice(1).map((l) => l.split("\t")[1])).toEqual([
      "default/cli/reverser:step0",
      "default/cli/reverser:step4",
    ]);

    let streamed = "";
    const text = await remote.chat(
      client,
      {
        model: "default/cli/reverser",
        messages: [{ role: "user", content: "Reverse the word cat." }],
        maxTokens: 6,
      },
      (t) => {
        streamed += t;
      },
    );
    expect(text).toBe(streamed);
    expect(text.length).toBeGreaterThan(0);

    // The trained step out as a tar, unpacked to a folder, and in again on a second model.
    const tarFile = join(dir, "reverser.tar");
    const downloaded = capture();
    await remote.downloadCheckpoint(
      client,
      { model: modelId, step: 4, format: "peft", file: tarFile },
      downloaded.out,
    );
    expect(downloaded.lines).toEqual([
      expect.stringMatching(/^wrote .*reverser\.tar \(\d+ bytes, peft\)$/),
    ]);
    const files = await readAdapterTar(readFileSync(tarFile));
    const folder = join(dir, "adapter");
    mkdirSync(folder);
    for (const [name, bytes] of Object.entries(files)) writeFileSync(join(folder, name), bytes);
    const copyId = await remote.createModel(
      client,
      { project: "cli", name: "copy", base: "arbor/tiny-chat" },
      capture().out,
    );
    for (const path of [folder, tarFile]) {
      const uploaded = capture();
      await remote.uploadCheckpoint(client, { model: copyId, path }, uploaded.out);
      expect(uploaded.lines).toEqual([
        expect.stringMatching(/^step \d: default\/cli\/copy:step\d$/),
      ]);
    }
    await expect(
      remote.downloadCheckpoint(
        client,
        { model: modelId, step: 9, format: "peft", file: join(dir, "none.tar") },
        capture().out,
      ),
    ).rejects.toThrow(/no checkpoint at step 9/);
    expect(existsSync(join(dir, "none.tar.partial"))).toBe(false);
  });

  it("when the progress bar is drawn, then it fills in proportion", () => {
    expect(remote.progressBar(0, 4, 8)).toBe("[........]");
    expect(remote.progressBar(2, 4, 8)).toBe("[####....]");
    expect(remote.progressBar(4, 4, 8)).toBe("[########]");
  });
});
