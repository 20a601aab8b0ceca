import { execFile, execFileSync } from "node:child_process";
import {
  existsSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  realpathSync,
  rmSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { promisify } from "node:util";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { PATIENT } from "../../../vitest.shared.ts";
import { type RunningServer, startServer } from "./harness.ts";
import { NODE_20, node20 } from "./node20.ts";

/**
 * @arbor/client as another team gets it: packed, installed with npm into a folder outside the
 * workspace, a consumer program type-checked there with `tsc --strict` (no @types/node), then
 * run against a live server under the machine's Node 20 and under Node 24.
 */
const root = resolve(import.meta.dirname, "../../..");
const clientDir = join(root, "packages/client");
const fixture = join(root, "tests/contract/fixtures/client-consumer");
const tsc = join(root, "node_modules/typescript/bin/tsc");
const run = promisify(execFile);

let server: RunningServer;
let work: string;

beforeAll(async () => {
  server = await startServer({}, { worker: true });
  work = mkdtempSync(join(tmpdir(), "arbor-client-consumer-"));
  execFileSync("pnpm", ["pack", "--pack-destination", work], { cwd: clientDir, stdio: "pipe" });
  const tarball = readdirSync(work).find((f) => f.endsWith(".tgz"))!;
  writeFileSync(
    join(work, "package.json"),
    JSON.stringify({
      name: "consumer",
      private: true,
      type: "module",
      dependencies: { "@arbor/client": `file:./${tarball}` },
    }),
  );
  // npm, not pnpm: nothing of the workspace can leak in.
  // It reaches the npm registry for openapi-fetch and eventsource-parser: turbo passes the
  // machine's CA and proxy settings through (turbo.json), and a stuck install fails in time.
  // Under Node 20 where the machine has it, with --engine-strict: a dependency whose `engines`
  // leaves out the Node the package promises (">=20") fails the install, where a person's npm
  // would warn EBADENGINE.
  const npmCli = realpathSync(
    execFileSync("sh", ["-c", "command -v npm"], { encoding: "utf8" }).trim(),
  );
  execFileSync(
    node20 ? NODE_20 : process.execPath,
    [npmCli, "install", "--engine-strict", "--no-audit", "--no-fund", "--loglevel=error"],
    { cwd: work, stdio: "pipe", timeout: PATIENT.timeout },
  );
  for (const file of ["consumer.ts", "tsconfig.json"])
    writeFileSync(join(work, file), readFileSync(join(fixture, file)));
});

afterAll(async () => {
  await server?.close();
  if (work) rmSync(work, { recursive: true, force: true });
});

describe("@arbor/client from its tarball", () => {
  it("when packed, then it holds ESM with types and source maps, and depends on public packages only", () => {
    const manifest = JSON.parse(
      readFileSync(join(work, "node_modules/@arbor/client/package.json"), "utf8"),
    );
    expect(Object.keys(manifest.dependencies).sort()).toEqual([
      "eventsource-parser",
      "openapi-fetch",
    ]);
    expect(manifest.type).toBe("module");
    expect(manifest.exports["."]).toEqual({
      types: "./dist/index.d.ts",
      default: "./dist/index.js",
    });
    const dist = readdirSync(join(work, "node_modules/@arbor/client/dist"));
    expect(dist).toEqual(expect.arrayContaining(["index.js", "index.d.ts", "index.js.map"]));
    const spec = JSON.parse(readFileSync(join(root, "spec/dist/openapi.json"), "utf8"));
    expect(manifest.version).toBe(spec.info.version);
  });

  it("when the workspace is read, then each publishable package has a CHANGELOG.md with its version", () => {
    const publishable = ["spec", "packages", "apps"]
      .flatMap((group) =>
        group === "spec"
          ? [join(root, group)]
          : readdirSync(join(root, group)).map((d) => join(root, group, d)),
      )
      .filter((dir) => !JSON.parse(readFileSync(join(dir, "package.json"), "utf8")).private);
    expect(publishable).toEqual([clientDir, join(root, "apps/cli")]);
    for (const dir of publishable) {
      const { version } = JSON.parse(readFileSync(join(dir, "package.json"), "utf8"));
      expect(existsSync(join(dir, "CHANGELOG.md"))).toBe(true);
      expect(readFileSync(join(dir, "CHANGELOG.md"), "utf8")).toContain(`## ${version}`);
    }
  });

  it("when a consumer is type-checked with tsc --strict outside the workspace, then it compiles", () => {
    execFileSync(process.execPath, [tsc, "-p", "tsconfig.json"], { cwd: work, stdio: "pipe" });
  });

  it.each([["Node 24", process.execPath], ...(node20 ? [["Node 20", NODE_20]] : [])])(
    "when the consumer runs under %s, then it trains, follows, lists, chats and reads usage",
    async (name, node) => {
      const { stdout: version } = await run(node, ["--version"]);
      expect(version).toMatch(name === "Node 20" ? /^v20\./ : /^v2[4-9]\./);
      // Asynchronously: the server answering the consumer runs in this process.
      const { stdout: out } = await run(node, ["out/consumer.js", name.replace(" ", "")], {
        cwd: work,
        env: { ...process.env, ARBOR_BASE_URL: server.baseUrl, ARBOR_API_KEY: server.adminKey },
      });
      const result = JSON.parse(out.trim().split("\n").at(-1)!);
      expect(result).toMatchObject({
        version: expect.stringMatching(/^\d+\.\d+\.\d+/),
        dataset: 8,
        status: "succeeded",
        listedJobs: true,
        text: true,
        notFound: "404 training_job_not_found",
      });
      expect(result.eventTypes).toEqual(
        expect.arrayContaining([
          "training_started",
          "gradient_step",
          "checkpoint_saved",
          "training_ended",
        ]),
      );
      expect(result.steps[0]).toBe(0);
      expect(result.steps.at(-1)).toBeGreaterThan(0);
      expect(result.streamedTokens).toBeGreaterThan(0);
      expect(result.completionTokens).toBeGreaterThanOrEqual(result.streamedTokens);
    },
  );
});
