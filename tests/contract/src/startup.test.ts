import { execFile } from "node:child_process";
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { promisify } from "node:util";
import { afterAll, describe, expect, it } from "vitest";
import { PATIENT } from "../../../vitest.shared.ts";
import { dropSchema, PG_URL, pgSkipReason } from "./pg.ts";
import { type Child, serverMain, startServerProcess } from "./processes.ts";

/**
 * A server that cannot start says why in one line and exits non-zero: it never claims to listen
 * while another process holds the port, and never ends in a stack trace.
 */
const run = promisify(execFile);
const dirs: string[] = [];
const children: Child[] = [];

function tempDir(): string {
  const dir = mkdtempSync(join(tmpdir(), "arbor-startup-"));
  dirs.push(dir);
  return dir;
}

afterAll(async () => {
  for (const child of children) await child.kill9();
  for (const dir of dirs) rmSync(dir, { recursive: true, force: true });
});

/** Runs the server's main with `env`; resolves with how it ended. */
async function start(env: Record<string, string>) {
  const result = await run(process.execPath, [serverMain], {
    env: { ...process.env, ARBOR_LOG_LEVEL: "silent", ARBOR_EMBEDDED_WORKER: "off", ...env },
    timeout: PATIENT.timeout,
  }).then(
    (ok) => ({ code: 0, stderr: ok.stderr }),
    (err: { code: number; stderr: string }) => ({ code: err.code, stderr: err.stderr }),
  );
  // The first start prints its key; what matters is the last line.
  return { ...result, last: result.stderr.trim().split("\n").at(-1) ?? "" };
}

/** A data directory below a plain file. */
const blocked = join(tempDir(), "a-file", "data");
writeFileSync(join(blocked, "..").replace(/\/$/, ""), "not a folder");

describe("starting the server", () => {
  it("when the port is taken by another server, then the second prints one line and exits 1", async () => {
    const first = await startServerProcess(tempDir(), { ARBOR_EMBEDDED_WORKER: "off" });
    children.push(first.child);
    await first.client.health.retrieve();
    const second = await start({ ARBOR_DATA_DIR: tempDir(), ARBOR_PORT: String(first.port) });
    expect(second.code).toBe(1);
    expect(second.last).toBe(
      `arbor: cannot start: 127.0.0.1:${first.port} is already in use (set ARBOR_PORT to another port)`,
    );
    expect(second.stderr).not.toMatch(/listening|\n\s+at /);
  });

  it.each([
    [
      // (Tests run as root here, so permissions would not stop it: a file where a folder
      // should be does.)
      "the data directory cannot be created",
      { ARBOR_DATA_DIR: blocked },
      /^arbor: cannot start: cannot write .*\(ENOTDIR\): set ARBOR_DATA_DIR to a directory this user can write$/,
    ],
    [
      "the database cannot be reached",
      { DATABASE_URL: "postgres://postgres@127.0.0.1:1/test", ARBOR_PORT: "0" },
      /^arbor: cannot start: cannot reach the database at 127\.0\.0\.1:1 \(ECONNREFUSED\): check DATABASE_URL$/,
    ],
    [
      "the Redis that keeps the rate limits cannot be reached",
      { ARBOR_REDIS_URL: "redis://127.0.0.1:1" },
      /^arbor: cannot start: cannot reach Redis at 127\.0\.0\.1:1 \(ECONNREFUSED\): check ARBOR_REDIS_URL$/,
    ],
  ])("when %s, then one line says what to change and the exit code is 1", async (_, env, line) => {
    const ended = await start({ ARBOR_DATA_DIR: tempDir(), ARBOR_PORT: "0", ...env });
    expect(ended.stderr.trim().split("\n")).toHaveLength(1);
    expect(ended.code).toBe(1);
    expect(ended.last).toMatch(line);
    expect(ended.stderr).not.toMatch(/\n\s+at /);
  });

  it.skipIf(pgSkipReason !== null)(
    "when a PostgreSQL deployment's files are still in its data directory and not in the database, then it refuses to start until they are imported",
    async () => {
      const dataDir = tempDir();
      const file = join(dataDir, "blobs", "checkpoints", "m", "1-x", "adapter_config.json");
      mkdirSync(dirname(file), { recursive: true });
      writeFileSync(file, "{}");
      const schema = `arbor_startup_${process.pid}_${Date.now()}`;
      const env = { ARBOR_DATA_DIR: dataDir, ARBOR_PORT: "0", DATABASE_URL: PG_URL };
      try {
        const ended = await start({ ...env, ARBOR_DATABASE_SCHEMA: schema });
        expect(ended.code).toBe(1);
        expect(ended.last).toMatch(
          /^arbor: cannot start: .*blobs holds 1 checkpoint and dataset files, and PostgreSQL, .* holds none\. Copy them in with "arbor blobs import", or set ARBOR_BLOBS=fs/,
        );
        // Chosen on purpose, it starts (and warns).
        const chosen = await startServerProcess(dataDir, {
          ...env,
          ARBOR_DATABASE_SCHEMA: schema,
          ARBOR_BLOBS: "postgres",
          ARBOR_EMBEDDED_WORKER: "off",
        });
        children.push(chosen.child);
        expect(chosen.child.logs.some((l) => String(l.msg).includes("does not read"))).toBe(true);
      } finally {
        await dropSchema(schema);
      }
    },
  );
});
