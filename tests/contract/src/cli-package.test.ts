import { execFile, execFileSync } from "node:child_process";
import {
  cpSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  writeFileSync,
} from "node:fs";
import { isBuiltin } from "node:module";
import { tmpdir } from "node:os";
import { dirname, join, relative, resolve } from "node:path";
import { promisify } from "node:util";
import { catalogModelDir } from "@arbor/engine/model";
import { shippedModelFiles, startHubStandin } from "@arbor/engine/test/hub-standin";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { PATIENT } from "../../../vitest.shared.ts";
import { type RunningServer, startServer } from "./harness.ts";
import { reversalJsonl } from "./jobs.ts";
import { NODE_20, node20 } from "./node20.ts";
import { dropSchema, PG_URL, pgSkipReason } from "./pg.ts";

/**
 * The `arbor` command as a person installs it: apps/cli packed with `pnpm pack`, installed with
 * `npm install -g` into a temporary prefix, and run from that prefix's bin, in a temporary
 * folder with nothing of the checkout reachable, against a live server, under the project's
 * Node 24 and the machine's Node 20 (ADR 42).
 */
const root = resolve(import.meta.dirname, "../../..");
const cliDir = join(root, "apps/cli");
const cliManifest = JSON.parse(readFileSync(join(cliDir, "package.json"), "utf8")) as {
  version: string;
};
/** The shipped model's folder, copied for `arbor models add-base`. */
const tinyChat = catalogModelDir("arbor/tiny-chat");

const execFileAsync = promisify(execFile);

let server: RunningServer;
let work: string;
let prefix: string;
let installed: string;
/** An empty folder: each command's cwd and HOME. */
let home: string;

beforeAll(async () => {
  if (!existsSync(join(cliDir, "dist/arbor.js")))
    throw new Error("apps/cli/dist is missing: turbo builds it before this test (pnpm build).");
  server = await startServer({}, { worker: true });
  work = mkdtempSync(join(tmpdir(), "arbor-cli-package-"));
  execFileSync("pnpm", ["pack", "--pack-destination", work], { cwd: cliDir, stdio: "pipe" });
  const tarball = join(work, `arbor-cli-${cliManifest.version}.tgz`);
  prefix = join(work, "prefix");
  // npm, not pnpm, as a person installs it. It needs no registry: the package has no
  // dependencies (a stuck install fails in time all the same).
  execFileSync(
    "npm",
    ["install", "-g", "--prefix", prefix, "--no-audit", "--no-fund", "--loglevel=error", tarball],
    { cwd: work, stdio: "pipe", timeout: PATIENT.timeout },
  );
  installed = join(prefix, "lib/node_modules/@arbor/cli");
  home = join(work, "home");
  mkdirSync(home);
  writeFileSync(join(work, "data.jsonl"), reversalJsonl(["cat", "dog", "sun", "map"]));
  // Preference pairs (ADR 69): the reversal over the word as it is.
  writeFileSync(
    join(work, "pairs.jsonl"),
    ["cat", "dog", "sun", "map"]
      .map((w) =>
        JSON.stringify({
          input: { messages: [{ role: "user", content: `Reverse the word ${w}.` }] },
          preferred_output: [{ role: "assistant", content: [...w].reverse().join("") }],
          non_preferred_output: [{ role: "assistant", content: w }],
        }),
      )
      .join("\n"),
  );
});

afterAll(async () => {
  await server?.close();
  if (work) rmSync(work, { recursive: true, force: true });
});

interface Result {
  code: number;
  stdout: string;
  stderr: string;
}

/**
 * `arbor ARGS` from the prefix's bin, its `#!/usr/bin/env node` finding `node` first on PATH.
 * The environment is only PATH, HOME and the settings given: no NODE_OPTIONS, no NODE_PATH.
 * Asynchronous: the server answering it runs in this process.
 */
async function arbor(node: string, args: string[], env: Record<string, string> = {}) {
  const bin = join(prefix, "bin");
  try {
    const { stdout, stderr } = await execFileAsync(join(bin, "arbor"), args, {
      cwd: home,
      env: {
        PATH: `${bin}:${dirname(node)}:/usr/bin:/bin`,
        HOME: home,
        ARBOR_DATA_DIR: join(home, ".arbor"),
        ...env,
      },
      timeout: PATIENT.timeout,
    });
    return { code: 0, stdout, stderr } satisfies Result;
  } catch (err) {
    const e = err as { code?: unknown; stdout?: string; stderr?: string };
    if (typeof e.code !== "number") throw err;
    return { code: e.code, stdout: e.stdout ?? "", stderr: e.stderr ?? "" } satisfies Result;
  }
}

/** Runs `arbor ARGS` and expects it to succeed, answering its stdout. */
async function ok(node: string, args: string[], env: Record<string, string> = {}) {
  const result = await arbor(node, args, env);
  expect(result, `arbor ${args.join(" ")}`).toMatchObject({ code: 0, stderr: "" });
  return result.stdout;
}

/** Every file under `dir`, relative to it. */
function files(dir: string): string[] {
  return readdirSync(dir, { recursive: true, withFileTypes: true })
    .filter((e) => e.isFile())
    .map((e) => relative(dir, join(e.parentPath, e.name)))
    .sort();
}

describe("the arbor command from its tarball", () => {
  it("when packed and installed, then it holds the bin, the bundle, the engine's kernels and its docs, and depends on nothing", () => {
    const manifest = JSON.parse(readFileSync(join(installed, "package.json"), "utf8"));
    expect(manifest.private).toBeUndefined();
    expect(manifest.version).toBe(cliManifest.version);
    expect(manifest.engines).toEqual({ node: ">=20" });
    expect(Object.keys(manifest.bin)).toEqual(["arbor"]);
    expect(manifest.bin.arbor.replace(/^\.\//, "")).toBe("bin/arbor.js");
    expect(manifest.dependencies).toBeUndefined();
    expect(manifest.exports).toEqual({ "./package.json": "./package.json" });
    const list = files(installed);
    expect(list).toEqual(
      expect.arrayContaining([
        "CHANGELOG.md",
        "README.md",
        "bin/arbor.js",
        "dist/THIRD-PARTY-LICENSES.txt",
        "dist/arbor.js",
        "dist/wasm/kernels-relaxed.wasm",
        "dist/wasm/kernels-simd.wasm",
        "package.json",
      ]),
    );
    expect(list.filter((f) => !/^(bin|dist)\/|^[A-Z-]+\.md$|^package\.json$/.test(f))).toEqual([]);
    expect(list.filter((f) => f.endsWith(".ts"))).toEqual([]);
    expect(readFileSync(join(installed, "CHANGELOG.md"), "utf8")).toContain(
      `## ${cliManifest.version}`,
    );
    // What the bundle imports at run time: Node's built-ins and its own chunks; pg-native only
    // when pg.native is read, which the store never does, and @redis/client only for rate
    // limits in Redis, which only a server keeps.
    const imported = new Set<string>();
    for (const file of list.filter((f) => f.endsWith(".js"))) {
      const text = readFileSync(join(installed, file), "utf8");
      for (const [, spec] of text.matchAll(
        /(?:^(?:import|export)\s[^"';]*?from\s*|^import\s*|\bimport\(\s*|(?:\b|__)require\(\s*)["']([^"']+)["']/gm,
      ))
        if (!spec!.startsWith(".") && !isBuiltin(spec!)) imported.add(spec!);
    }
    expect([...imported].sort()).toEqual(["@redis/client", "pg-native"]);
    expect(existsSync(join(prefix, "bin/arbor"))).toBe(true);
  });

  it.each([["Node 24", process.execPath], ...(node20 ? [["Node 20", NODE_20]] : [])])(
    "when run under %s away from the checkout, then it prints its version and help, trains a model it created on data it uploaded, and chats with it",
    async (name, node) => {
      expect(execFileSync(node, ["--version"], { encoding: "utf8" })).toMatch(
        name === "Node 20" ? /^v20\./ : /^v2[4-9]\./,
      );
      const tag = name.replace(" ", "").toLowerCase();
      expect(await ok(node, ["--version"])).toBe(`arbor ${cliManifest.version}\n`);
      const help = await ok(node, ["--help"]);
      for (const command of [
        "models create",
        "datasets upload",
        "train sft",
        "chat",
        "keys create",
      ])
        expect(help).toContain(`arbor ${command} `);

      const server_ = { ARBOR_BASE_URL: server.baseUrl, ARBOR_API_KEY: server.adminKey };
      const model = `default/package/${tag}`;
      expect(
        await ok(node, ["models", "create", "--project", "package", "--name", tag], server_),
      ).toMatch(
        new RegExp(`^Model [0-9a-f-]{36}: ${model} \\(base arbor/tiny-chat, step 0\\)\\n$`),
      );
      const uploaded = await ok(node, ["datasets", "upload", join(work, "data.jsonl")], server_);
      const url = /^Uploaded 4 lines \(\d+ bytes\): (dataset:\/\/\S+)\n$/.exec(uploaded)?.[1];
      expect(url, uploaded).toBeDefined();
      const trained = await ok(
        node,
        [
          ...["train", "sft", "--model", model, "--data", url!],
          ...["--epochs", "1", "--batch-size", "2", "--follow"],
        ],
        server_,
      );
      expect(trained).toMatch(/^SFT job \S+ queued\.\n/);
      expect(trained).toContain("Training started: 2 steps.\n");
      expect(trained).toMatch(/\[#{24}\] step 2\/2 {2}loss \d+\.\d{4}\n/);
      expect(trained).toMatch(/Training ended\.\n$/);
      // Then DPO on preference pairs, a local file uploaded first, from the SFT checkpoint.
      const preferred = await ok(
        node,
        [
          ...["train", "sft", "--model", model, "--data", join(work, "pairs.jsonl")],
          ...["--method", "dpo", "--dpo-beta", "0.2", "--epochs", "1", "--batch-size", "2"],
          "--follow",
        ],
        server_,
      );
      expect(preferred).toMatch(
        /^Uploaded 4 lines \(\d+ bytes\): dataset:\/\/\S+\nDPO job \S+ queued\.\n/,
      );
      expect(preferred).toMatch(/\[#{24}\] step 2\/2 {2}loss \d+\.\d{4}\n/);
      expect(preferred).toMatch(/Training ended\.\n$/);
      const checkpoints = await ok(node, ["checkpoints", "list", model], server_);
      expect(checkpoints).toContain(`\t${model}:step4\t`);
      const answer = await ok(
        node,
        ["chat", model, "--message", "Reverse the word cat.", "--max-tokens", "6"],
        server_,
      );
      expect(answer.trim().length).toBeGreaterThan(0);
    },
  );

  it.each([["Node 24", process.execPath], ...(node20 ? [["Node 20", NODE_20]] : [])])(
    "when a model folder is added under %s, then the engine's kernels load from the package and the server serves the folder",
    async (name, node) => {
      const folder = join(work, `tiny-${name.replace(" ", "")}`);
      cpSync(tinyChat, folder, { recursive: true });
      const id = `local/tiny-${name.replace(" ", "").toLowerCase()}`;
      expect(
        await ok(node, ["models", "add-base", folder, "--id", id], {
          ARBOR_DATA_DIR: server.dataDir,
        }),
      ).toBe(`Added ${id} (llama, 0.8M parameters) at ${join(server.dataDir, "models", id)}.\n`);
      // The server looks again for an unknown id at most once a second: now, for this test.
      await server.engines.refresh();
      // The same weights as the shipped model: the same greedy answer, served from the folder.
      const chat = (model: string) =>
        ok(
          node,
          [
            "chat",
            model,
            "--message",
            "What is 7 + 5?",
            "--temperature",
            "0",
            "--max-tokens",
            "12",
          ],
          { ARBOR_BASE_URL: server.baseUrl, ARBOR_API_KEY: server.adminKey },
        );
      const shipped = await chat("arbor/tiny-chat");
      expect(shipped.trim().length).toBeGreaterThan(0);
      expect(await chat(id)).toBe(shipped);
    },
  );

  it.each([["Node 24", process.execPath], ...(node20 ? [["Node 20", NODE_20]] : [])])(
    "when a model is pulled from a stand-in Hub under %s, then it lands whole in the server's models directory and is served",
    async (name, node) => {
      const tag = name.replace(" ", "").toLowerCase();
      const hub = await startHubStandin({
        repos: [{ id: `acme/tiny-${tag}`, refs: { main: shippedModelFiles() } }],
      });
      try {
        const id = `hub/tiny-${tag}`;
        const result = await arbor(node, ["models", "pull", `acme/tiny-${tag}`, "--id", id], {
          ARBOR_DATA_DIR: server.dataDir,
          HF_ENDPOINT: hub.endpoint,
        });
        expect(result, result.stderr).toMatchObject({ code: 0 });
        expect(result.stdout).toMatch(
          new RegExp(`^acme/tiny-${tag}@main is commit ${hub.commit(`acme/tiny-${tag}`)} `),
        );
        expect(result.stdout).toMatch(
          new RegExp(`Pulled acme/tiny-${tag} at [0-9a-f]{40} as ${id} `),
        );
        // Not a terminal: the progress is plain lines on stderr, ending at 100%.
        expect(result.stderr).toMatch(/\] 100% 3\.4 MB of 3\.4 MB {2}model\.safetensors\n$/);
        expect(result.stderr).not.toContain("\r");
        await server.engines.refresh();
        const { data } = await server.authorizedClient().models.list();
        expect(data.map((m) => m.id)).toContain(id);
      } finally {
        await hub.close();
      }
    },
  );

  it("when a store command runs under Node 24, then it opens the server's SQLite store: the key it creates works on the server", async () => {
    const created = await ok(
      process.execPath,
      ["keys", "create", "--user", "packaged", "--entity", "default"],
      { ARBOR_DATA_DIR: server.dataDir },
    );
    const token = created.trim().split("\n").at(-1)!;
    expect(created).toMatch(
      /^Created key \S+… \(id \S+\) for user "packaged" in entity "default"\./,
    );
    const models = await ok(process.execPath, ["models", "list"], {
      ARBOR_BASE_URL: server.baseUrl,
      ARBOR_API_KEY: token,
    });
    expect(models.split("\n")[0]).toBe("id\tmodel\tbase\tlatest step\tcreated");
    const listed = await ok(process.execPath, ["keys", "list", "--user", "packaged"], {
      ARBOR_DATA_DIR: server.dataDir,
    });
    expect(listed).toContain(`packaged\tdefault\t`);
  });

  it.skipIf(pgSkipReason !== null)(
    "when a store command runs under Node 24 with DATABASE_URL, then the bundled pg reaches PostgreSQL",
    async () => {
      const schema = `arbor_cli_package_${process.pid}`;
      const env = { DATABASE_URL: PG_URL, ARBOR_DATABASE_SCHEMA: schema };
      try {
        await ok(
          process.execPath,
          ["prices", "set", "--model", "arbor/tiny-chat", "--prompt", "0.5", "--completion", "1"],
          env,
        );
        const listed = await ok(process.execPath, ["prices", "list"], env);
        expect(listed.split("\n")[1]).toMatch(
          /^\S+\tarbor\/tiny-chat\t\(default\)\t\S+\t0\.5\t1\t/,
        );
      } finally {
        await dropSchema(schema);
      }
    },
  );

  it.skipIf(!node20)(
    "when a store command runs under Node 20, then one line says it needs Node 24 and it exits 1 without touching the store",
    async () => {
      const dataDir = join(work, "untouched");
      for (const args of [
        ["keys", "list"],
        ["keys", "create", "--user", "u", "--entity", "e"],
        ["prices", "list"],
        ["blobs", "import"],
      ]) {
        const result = await arbor(NODE_20, args, { ARBOR_DATA_DIR: dataDir });
        const version = execFileSync(NODE_20, ["-p", "process.versions.node"], {
          encoding: "utf8",
        }).trim();
        expect(result.code).toBe(1);
        expect(result.stdout).toBe("");
        expect(result.stderr).toMatch(
          new RegExp(
            `^arbor: "arbor ${args.slice(0, 2).join(" ")}" needs Node 24 or later \\(it opens the Arbor store with node:sqlite\\); this is Node ${version.replaceAll(".", "\\.")}\\. [^\\n]+\\n$`,
          ),
        );
      }
      expect(existsSync(dataDir)).toBe(false);
    },
  );
});
