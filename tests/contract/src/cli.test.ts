import { spawn } from "node:child_process";
import { once } from "node:events";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import * as remote from "@arbor/cli/remote";
import { readAdapterTar } from "@arbor/training";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { reversalJsonl } from "./jobs.ts";

/** The `arbor` command's remote commands, against a real server. */
let server: RunningServer;
const root = resolve(import.meta.dirname, "../../..");
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
    // A first job's steps are the model's: one number says both.
    expect(lines).toContain("Checkpoint saved at step 4/4.");
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

  it("when a model trains a second time, then its checkpoint is told in the job's steps and the model's", async () => {
    const client = server.authorizedClient();
    const file = join(dir, "again.jsonl");
    writeFileSync(file, reversalJsonl(["cat", "dog"]));
    await remote.createModel(
      client,
      { project: "cli", name: "twice", base: "arbor/tiny-chat" },
      capture().out,
    );
    for (const expected of [
      "Checkpoint saved at step 2/2.",
      "Checkpoint saved at step 2/2 (the model's step 4).",
    ]) {
      const { lines, out } = capture();
      const job = await remote.trainSft(
        client,
        { model: "default/cli/twice", data: file, config: { epochs: 2, batch_size: 2 } },
        out,
      );
      await remote.followJob(client, { job }, out);
      expect(lines).toContain(expected);
    }
  });

  it("when a validation file is given, then it is uploaded too and the follow prints a validation line at the start, each eval_every steps and the end", async () => {
    const client = server.authorizedClient();
    const data = join(dir, "train-v.jsonl");
    const held = join(dir, "held-out.jsonl");
    writeFileSync(data, reversalJsonl(["cat", "dog", "sun", "map"]));
    writeFileSync(held, reversalJsonl(["pen", "cup"]));
    await remote.createModel(
      client,
      { project: "cli", name: "validated", base: "arbor/tiny-chat" },
      capture().out,
    );
    const { lines, out } = capture();
    const job = await remote.trainSft(
      client,
      {
        model: "default/cli/validated",
        data,
        validation: held,
        config: { epochs: 2, batch_size: 2, eval_every: 2 },
      },
      out,
    );
    expect(lines.filter((l) => l.startsWith("Uploaded 2 lines"))).toHaveLength(1);
    expect((await client.training.jobs.retrieve(job)).config).toMatchObject({
      validation_data_url: expect.stringMatching(/^dataset:\/\//),
    });
    await remote.followJob(client, { job }, out);
    const validations = lines.filter((l) => l.startsWith("Validation"));
    expect(validations.map((l) => l.replace(/:.*/, ""))).toEqual([
      "Validation at step 0/4",
      "Validation at step 2/4",
      "Validation at step 4/4",
    ]);
    for (const line of validations)
      expect(line).toMatch(/: loss \d+\.\d{4} {2}token accuracy \d+\.\d% \(2 examples\)$/);
  });

  it("when a dataset file is missing, empty or blank, then the error says so in words and nothing is sent", async () => {
    const client = server.authorizedClient();
    const missing = join(dir, "missing.jsonl");
    const empty = join(dir, "empty.jsonl");
    const blank = join(dir, "blank.jsonl");
    writeFileSync(empty, "");
    writeFileSync(blank, "\n\n");
    const { lines, out } = capture();
    await expect(remote.uploadDataset(client, { file: missing }, out)).rejects.toThrow(
      new Error(`Cannot read the dataset ${missing}: there is no such file.`),
    );
    await expect(remote.uploadDataset(client, { file: dir }, out)).rejects.toThrow(
      new Error(`Cannot read the dataset ${dir}: it is a folder, not a file.`),
    );
    await expect(remote.uploadDataset(client, { file: empty }, out)).rejects.toThrow(
      new Error(`The dataset ${empty} is empty.`),
    );
    await expect(remote.uploadDataset(client, { file: blank }, out)).rejects.toThrow(
      /^The dataset .*blank\.jsonl holds only blank lines: it needs one JSON example a line/,
    );
    await expect(
      remote.uploadCheckpoint(client, { model: "default/cli/twice", path: missing }, out),
    ).rejects.toThrow(
      new Error(`Cannot read the adapter ${missing}: there is no such file or folder.`),
    );
    expect(lines).toEqual([]);
  });

  it("when the key is refused, then the error comes alone, before any table header, in one sentence each", async () => {
    const { run } = await import("@arbor/cli/commands");
    const saved = { ...process.env };
    process.env.ARBOR_BASE_URL = server.baseUrl;
    process.env.ARBOR_API_KEY = "sk-arbor-not-a-key";
    const lines: string[] = [];
    try {
      for (const argv of [
        ["jobs", "list"],
        ["models", "list"],
      ]) {
        const error = await run(argv, { line: (t) => lines.push(t), write: () => {} }).then(
          () => undefined,
          (err: Error) => err,
        );
        expect(error?.message).toBe(
          `The server at ${server.baseUrl} refused the API key from ARBOR_API_KEY (401 Invalid API key). Set ARBOR_API_KEY to a valid key (arbor keys create).`,
        );
      }
      expect(lines).toEqual([]);
    } finally {
      for (const k of ["ARBOR_BASE_URL", "ARBOR_API_KEY"]) {
        if (saved[k] === undefined) delete process.env[k];
        else process.env[k] = saved[k];
      }
    }
  });

  it.each([
    ["from the checkout (./scripts/arbor)", "apps/cli/src/main.ts"],
    ["bundled, as installed", "apps/cli/bin/arbor.js"],
  ])(
    "when its output is piped into a reader that has gone (| head -1), %s, then it stops quietly",
    async (_, entry) => {
      // The read end is closed before the command writes: its first write meets EPIPE.
      const child = spawn(process.execPath, [join(root, entry), "help"], {
        stdio: ["ignore", "pipe", "pipe"],
      });
      child.stdout.destroy();
      let stderr = "";
      child.stderr.on("data", (d: Buffer) => {
        stderr += d;
      });
      const [code] = (await once(child, "exit")) as [number | null];
      expect({ code, stderr }).toEqual({ code: 0, stderr: "" });
    },
  );

  it("when Ctrl-C stops a follow, then it says the job keeps running and how to follow or cancel it", async () => {
    const client = server.authorizedClient();
    const file = join(dir, "long.jsonl");
    writeFileSync(file, reversalJsonl(["cat", "dog"]));
    await remote.createModel(
      client,
      { project: "cli", name: "interrupted", base: "arbor/tiny-chat" },
      capture().out,
    );
    const job = await remote.trainSft(
      client,
      { model: "default/cli/interrupted", data: file, config: { epochs: 500, batch_size: 1 } },
      capture().out,
    );
    const child = spawn(
      process.execPath,
      [join(root, "apps/cli/src/main.ts"), "jobs", "follow", job],
      {
        stdio: ["ignore", "pipe", "pipe"],
        env: { ...process.env, ARBOR_BASE_URL: server.baseUrl, ARBOR_API_KEY: server.adminKey },
      },
    );
    let stdout = "";
    let stderr = "";
    child.stderr.on("data", (d: Buffer) => {
      stderr += d;
    });
    const exited = once(child, "exit");
    // Interrupted once it follows: after its first step is printed (reading on, so that its
    // output has somewhere to go).
    await new Promise<void>((resolve) => {
      child.stdout.on("data", (d: Buffer) => {
        stdout += d;
        if (/step \d+\/1000/.test(stdout)) resolve();
      });
    });
    child.kill("SIGINT");
    const [code] = (await exited) as [number | null];
    expect({ code, stderr }).toEqual({
      code: 130,
      stderr: `Stopped following. Job ${job} keeps running on the server: "arbor jobs follow ${job}" to watch it again, "arbor jobs cancel ${job}" to stop it.\n`,
    });
    expect((await client.training.jobs.retrieve(job)).status).toBe("running");
    await client.training.jobs.cancel(job);
  });

  it("when the progress bar is drawn, then it fills in proportion", () => {
    expect(remote.progressBar(0, 4, 8)).toBe("[........]");
    expect(remote.progressBar(2, 4, 8)).toBe("[####....]");
    expect(remote.progressBar(4, 4, 8)).toBe("[########]");
  });
});
