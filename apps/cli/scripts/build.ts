/**
 * Bundles the `arbor` command into dist/ (ADR 42): src/main.ts and everything of ours and of npm
 * it imports, as ESM for Node 20, split so that the store (node:sqlite) and the engine load only
 * when a command uses them. The engine's WebAssembly kernels are copied beside the bundle, where
 * its `new URL("./wasm/…", import.meta.url)` finds them. Every such URL in the output is checked:
 * one that names a file the package does not hold fails the build, unless it is listed below
 * with the reason the CLI never reaches it. The licences of the npm packages bundled go in
 * dist/THIRD-PARTY-LICENSES.txt.
 */
import {
  copyFileSync,
  existsSync,
  mkdirSync,
  readdirSync,
  readFileSync,
  rmSync,
  writeFileSync,
} from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { build } from "esbuild";

const cli = join(import.meta.dirname, "..");
const dist = join(cli, "dist");

/** Asset URLs in the bundle that no CLI command reaches, and why. */
const UNREACHED: Record<string, string> = {
  "./engine-thread-worker.ts": "the engine's serving threads: the CLI serves nothing",
  "./prompt-worker.ts": "the engine's prompt encoder thread: the CLI serves nothing",
  "./pool-worker.ts": "the kernels' helper threads: add-base and pull compute nothing",
  "../../models/":
    "the shipped models' folders: add-base and pull check the folder they are given (the catalogue's list is bundled)",
};

rmSync(dist, { recursive: true, force: true });
const result = await build({
  absWorkingDir: cli,
  entryPoints: { arbor: "src/main.ts" },
  outdir: dist,
  bundle: true,
  splitting: true,
  format: "esm",
  platform: "node",
  target: "node20",
  metafile: true,
  legalComments: "none",
  logLevel: "warning",
  // pg asks for its native binding only when `pg.native` is read, which the store never does.
  // The store loads @redis/client only for rate limits kept in Redis, which only a server has.
  external: ["pg-native", "@redis/client"],
  // CommonJS packages in the bundle (pg, tar-stream) call require() for Node's built-ins.
  banner: {
    js: 'import { createRequire as __arborCreateRequire } from "node:module"; const require = __arborCreateRequire(import.meta.url);',
  },
});

// The engine's kernels, where its code looks for them relative to the chunk that holds it.
const kernels = dirname(fileURLToPath(import.meta.resolve("@arbor/engine/kernels")));
const wasm = join(kernels, "wasm");
mkdirSync(join(dist, "wasm"));
for (const file of readdirSync(wasm).filter((f) => f.endsWith(".wasm")))
  copyFileSync(join(wasm, file), join(dist, "wasm", file));

const missing: string[] = [];
for (const output of Object.keys(result.metafile.outputs).filter((f) => f.endsWith(".js"))) {
  const text = readFileSync(join(cli, output), "utf8");
  for (const [, ref] of text.matchAll(/new URL\(\s*"([^"]+)",\s*import\.meta\.url\s*\)/g)) {
    if (ref! in UNREACHED) continue;
    if (!existsSync(fileURLToPath(new URL(ref!, `file://${join(dist, "x.js")}`))))
      missing.push(`${output}: ${ref}`);
  }
}
// Each bundled npm package once: its name, version, licence and licence text.
const notices = new Map<string, string>();
for (const input of Object.keys(result.metafile.inputs)) {
  const at = /^(.*\/node_modules\/(?:@[^/]+\/)?[^/]+)\//.exec(input)?.[1];
  if (!at || notices.has(at)) continue;
  const dir = join(cli, at);
  const manifest = JSON.parse(readFileSync(join(dir, "package.json"), "utf8")) as {
    name: string;
    version: string;
    license?: string;
  };
  const text = licenceText(dir);
  if (!text) {
    console.error(`${manifest.name} has no licence text to ship with the bundle.`);
    process.exit(1);
  }
  notices.set(
    at,
    `${manifest.name}@${manifest.version} (${manifest.license ?? "see below"})\n\n${text}\n`,
  );
}
writeFileSync(
  join(dist, "THIRD-PARTY-LICENSES.txt"),
  `The arbor command bundles these npm packages:\n\n${[...notices.values()].sort().join(`\n${"-".repeat(72)}\n\n`)}`,
);

if (missing.length) {
  console.error(`The bundle refers to files the package does not hold:\n  ${missing.join("\n  ")}`);
  process.exit(1);
}

/** A package's licence file, or else its README's licence section (pg-types has only that). */
function licenceText(dir: string): string | undefined {
  const files = readdirSync(dir);
  const file = files.find((f) => /^(licen[cs]e|copying)/i.test(f));
  if (file) return readFileSync(join(dir, file), "utf8").trim();
  const readme = files.find((f) => /^readme/i.test(f));
  if (!readme) return undefined;
  const section = /^(#+)\s*licen[cs]e\s*\n([\s\S]*?)(?=^#{1,6}\s|(?![\s\S]))/im.exec(
    readFileSync(join(dir, readme), "utf8"),
  );
  return section?.[2]?.trim() || undefined;
}
