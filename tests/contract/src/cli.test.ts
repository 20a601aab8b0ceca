import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import * as remote from "@arbor/cli/remote";
import { readAdapterTar } from "@arbor/training";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { reversalJsonl } from "./jobs.ts";

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
    writeFileSync(file, reversalJsonl(["cat", "dog", "sun", "map"]));
    const { lines, bars, out } = capture();
    const modelId = await remote.createModel(
      client,
      { project: "cli", name: "reverser", base: "arbor/tiny-chat" },
      out,
    );
    const jobId = await remote.trainSft(
      client,
      // By name, as a person types it.
      { model: "default/cli/reverser", data: file, config: { epochs: 2, batch_size: 2 } },
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

  it("when a model is named that does not exist, then training fails before anything is uploaded", async () => {
    const client = server.authorizedClient();
    const file = join(dir, "never.jsonl");
    writeFileSync(
      file,
      '{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}]}',
    );
    const { lines, out } = capture();
    await expect(
      remote.trainSft(client, { model: "default/cli/no-such-model", data: file }, out),
    ).rejects.toThrow(/No trained model "default\/cli\/no-such-model".*arbor models list/);
    expect(lines).toEqual([]);
  });

  it("when models and jobs are listed, then names resolve and each shows once, newest first", async () => {
    const client = server.authorizedClient();
    const { out } = capture();
    const id = await remote.createModel(
      client,
      { project: "cli", name: "listed", base: "arbor/tiny-chat" },
      out,
    );
    const models = capture();
    await remote.listModels(client, { project: "cli" }, models.out);
    expect(models.lines[0]).toBe("id\tmodel\tbase\tlatest step\tcreated");
    expect(models.lines.filter((l) => l.startsWith(`${id}\tdefault/cli/listed\t`))).toHaveLength(1);
    const jobs = capture();
    await remote.listJobs(client, { model: "default/cli/listed" }, jobs.out);
    expect(jobs.lines).toEqual(["id\ttype\tmodel\tstatus\tsteps\tcreated"]);
    const checkpoints = capture();
    await remote.listCheckpoints(client, { model: "default/cli/listed" }, checkpoints.out);
    expect(checkpoints.lines[1]).toMatch(/^0\tdefault\/cli\/listed:step0\t/);
  });

  it("when no key is set and none was written, then the error says where it looked and what to set", async () => {
    const { run } = await import("@arbor/cli/commands");
    const empty = mkdtempSync(join(tmpdir(), "arbor-cli-nokey-"));
    const saved = { ...process.env };
    process.env.ARBOR_BASE_URL = server.baseUrl;
    process.env.ARBOR_DATA_DIR = empty;
    delete process.env.ARBOR_API_KEY;
    try {
      await expect(run(["models", "list"], { line: () => {}, write: () => {} })).rejects.toThrow(
        new RegExp(
          `No API key: ARBOR_API_KEY is not set and ${join(empty, "admin.key")} does not exist`,
        ),
      );
    } finally {
      for (const k of ["ARBOR_BASE_URL", "ARBOR_DATA_DIR", "ARBOR_API_KEY"]) {
        if (saved[k] === undefined) delete process.env[k];
        else process.env[k] = saved[k];
      }
      rmSync(empty, { recursive: true, force: true });
    }
  });

  it("when a cancelled job is followed, then it says so and is not a failure", async () => {
    const client = server.authorizedClient();
    const { out } = capture();
    await remote.createModel(
      client,
      { project: "cli", name: "to-cancel", base: "arbor/tiny-chat" },
      out,
    );
    const file = join(dir, "cancel.jsonl");
    writeFileSync(
      file,
      '{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}]}',
    );
    // A first job holds the model, so the second stays queued until it is cancelled.
    const first = await remote.trainSft(
      client,
      { model: "default/cli/to-cancel", data: file, config: { epochs: 200, batch_size: 1 } },
      out,
    );
    const second = await remote.trainSft(
      client,
      { model: "default/cli/to-cancel", data: file },
      out,
    );
    await remote.cancelJob(client, { job: second }, out);
    await remote.cancelJob(client, { job: first }, out);
    const followed = capture();
    const last = await remote.followJob(client, { job: second }, followed.out);
    expect(last?.type).toBe("training_failed");
    expect(followed.lines).toEqual(["Training cancelled."]);
  });

  it("when the progress bar is drawn, then it fills in proportion", () => {
    expect(remote.progressBar(0, 4, 8)).toBe("[........]");
    expect(remote.progressBar(2, 4, 8)).toBe("[####....]");
    expect(remote.progressBar(4, 4, 8)).toBe("[########]");
  });
});
