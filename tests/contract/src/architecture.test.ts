import { readdirSync, readFileSync, statSync } from "node:fs";
import { join, relative, sep } from "node:path";
import { describe, expect, it } from "vitest";

/**
 * The direction of dependencies (README, Layout): apps depend on packages, never on each other;
 * each package only on the packages below it. Checked in every package.json and in every import
 * of every source file, so a new import that breaks the direction fails here.
 */
const root = join(import.meta.dirname, "../../..");
const allowed: Record<string, readonly string[]> = {
  "@arbor/spec": [],
  "@arbor/config": [],
  "@arbor/engine": [],
  "@arbor/store": [],
  // A devDependency only: the client generates its types from the spec's bundle at build time
  // and imports nothing of ours, so that it installs alone (client-package.test.ts).
  "@arbor/client": ["@arbor/spec"],
  "@arbor/training": ["@arbor/engine", "@arbor/store", "@arbor/spec"],
  "@arbor/docs": ["@arbor/spec"],
  // The console is a browser app on the public client; the server serves its built files.
  "@arbor/console": ["@arbor/client"],
  "@arbor/server": [
    "@arbor/config",
    "@arbor/console",
    "@arbor/docs",
    "@arbor/engine",
    "@arbor/spec",
    "@arbor/store",
    "@arbor/training",
  ],
  "@arbor/worker": ["@arbor/config", "@arbor/store", "@arbor/training"],
  "@arbor/cli": ["@arbor/client", "@arbor/config", "@arbor/engine", "@arbor/store"],
};

/** What a source file may import: as above, but the client's code imports nothing of ours. */
const importable: Record<string, readonly string[]> = { ...allowed, "@arbor/client": [] };

interface Workspace {
  name: string;
  dir: string;
}

const workspaces: Workspace[] = ["spec", "packages", "apps"].flatMap((group) => {
  const base = join(root, group);
  const dirs = group === "spec" ? [base] : readdirSync(base).map((d) => join(base, d));
  return dirs.flatMap((dir) => {
    try {
      const pkg = JSON.parse(readFileSync(join(dir, "package.json"), "utf8")) as { name: string };
      return [{ name: pkg.name, dir }];
    } catch {
      return [];
    }
  });
});

function sources(dir: string): string[] {
  const out: string[] = [];
  for (const entry of readdirSync(dir)) {
    if (entry === "node_modules" || entry === "dist" || entry.startsWith(".")) continue;
    const path = join(dir, entry);
    if (statSync(path).isDirectory()) out.push(...sources(path));
    else if (/\.ts$/.test(entry)) out.push(path);
  }
  return out;
}

/** The specifiers a source file imports, re-exports, or loads by URL (a worker's module). */
function imports(file: string): string[] {
  const text = readFileSync(file, "utf8");
  return [
    ...text.matchAll(/(?:from|import)\s*\(?\s*["']([^"']+)["']/g),
    ...text.matchAll(/new URL\(\s*["']([^"']+\.ts)["'],\s*import\.meta\.url\s*\)/g),
  ].map(([, spec]) => spec!);
}

describe("the dependency direction", () => {
  it("when every workspace's package.json is read, then it depends only on what its layer may", () => {
    const wrong: string[] = [];
    for (const { name, dir } of workspaces) {
      const pkg = JSON.parse(readFileSync(join(dir, "package.json"), "utf8")) as {
        dependencies?: Record<string, string>;
        devDependencies?: Record<string, string>;
      };
      for (const dep of Object.keys({ ...pkg.dependencies, ...pkg.devDependencies })) {
        if (dep.startsWith("@arbor/") && !(allowed[name] ?? []).includes(dep))
          wrong.push(`${name} → ${dep}`);
      }
    }
    expect(wrong).toEqual([]);
  });

  it("when every source file's imports are read, then none reaches into another workspace but through what it may depend on", () => {
    const wrong: string[] = [];
    for (const { name, dir } of workspaces) {
      for (const file of sources(dir)) {
        for (const target of imports(file)) {
          if (target.startsWith("@arbor/")) {
            const pkg = target.split("/").slice(0, 2).join("/");
            if (pkg !== name && !(importable[name] ?? []).includes(pkg))
              wrong.push(`${relative(root, file)} imports ${target}`);
          } else if (target.startsWith(".")) {
            const resolved = join(file, "..", target);
            const owner = workspaces.find((w) => resolved.startsWith(`${w.dir}/`));
            if (owner && owner.name !== name)
              wrong.push(`${relative(root, file)} reaches into ${owner.name}: ${target}`);
          }
        }
      }
    }
    expect(wrong).toEqual([]);
  });
});

/**
 * The engine's layers (ADR 52; the engine's README, Layers and exports): each directory of its
 * src/ may import itself and the layers listed, nothing else of the engine. Its tests may
 * import any layer (a layer's tests exercise it with what uses it), so they are left out.
 */
const engine = join(root, "packages/engine");
const engineLayers: Record<string, readonly string[]> = {
  kernels: [],
  model: ["kernels"],
  serve: ["model", "kernels"],
  train: ["model", "kernels"],
};

/** The directory of the engine's src/ (its layer) that `file`'s import `target` is in; nothing
 * for anything else (another package, or the engine's data outside src/, like models/). */
function engineLayerOf(file: string, target: string): string | undefined {
  if (target.startsWith("@arbor/engine/")) return target.split("/")[2];
  if (!target.startsWith(".")) return undefined;
  const path = relative(join(engine, "src"), join(file, "..", target));
  return path.startsWith("..") ? undefined : path.split(sep)[0];
}

describe("the engine's layers", () => {
  it("when every engine module's imports are read, then each reaches only its own layer and those below it", () => {
    const wrong: string[] = [];
    for (const file of sources(join(engine, "src"))) {
      if (file.endsWith(".test.ts")) continue;
      const at = relative(root, file);
      const layer = relative(join(engine, "src"), file).split(sep)[0]!;
      const may = engineLayers[layer];
      if (!may) {
        wrong.push(
          `${at} is in no layer: move it into src/${Object.keys(engineLayers).join("/, src/")}/`,
        );
        continue;
      }
      for (const target of imports(file)) {
        const into = engineLayerOf(file, target);
        if (into === undefined || into === layer || may.includes(into)) continue;
        wrong.push(
          `${at} (${layer}) imports ${target} (${into}), but ${layer} may import only ${[layer, ...may].join(", ")}` +
            (into in engineLayers ? "; move what both use into a layer both may import" : ""),
        );
      }
    }
    expect(wrong).toEqual([]);
  });

  it("when the engine's package.json is read, then it exports each layer's index.ts and test helpers, and no root", () => {
    const pkg = JSON.parse(readFileSync(join(engine, "package.json"), "utf8")) as {
      exports: Record<string, unknown>;
    };
    const layers = Object.keys(pkg.exports).filter((key) => !key.startsWith("./test/"));
    expect(layers.sort()).toEqual(
      Object.keys(engineLayers)
        .map((layer) => `./${layer}`)
        .sort(),
    );
    for (const layer of Object.keys(engineLayers)) {
      expect(pkg.exports[`./${layer}`]).toEqual({
        types: `./src/${layer}/index.ts`,
        default: `./src/${layer}/index.ts`,
      });
    }
  });
});
