import { readFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import ts from "typescript";
import { describe, expect, it } from "vitest";

/**
 * Every operation in the spec shows at `/docs` how to call it: with curl and with
 * @arbor/client. The TypeScript samples are type-checked against the client as it is, so a
 * renamed method or field fails here rather than in a reader's editor.
 */
const root = resolve(import.meta.dirname, "../../..");
const spec = JSON.parse(readFileSync(join(root, "spec/dist/openapi.json"), "utf8")) as {
  paths: Record<string, Record<string, Operation>>;
};

interface Operation {
  operationId?: string;
  "x-codeSamples"?: { lang: string; label: string; source: string }[];
}

const METHODS = ["get", "post", "put", "patch", "delete"];
const operations = Object.entries(spec.paths).flatMap(([path, item]) =>
  METHODS.filter((m) => item[m]).map((method) => ({ path, method, op: item[method]! })),
);

/** What each sample may assume: a client, and Node's `process.stdout` for printing. */
const PREAMBLE = `import { createArborClient } from "@arbor/client";
declare const process: { stdout: { write(text: string): void } };
const client = createArborClient({ baseUrl: "http://127.0.0.1:8080", apiKey: "key" });
`;

function sample(op: Operation, lang: string): string {
  const found = op["x-codeSamples"]?.find((s) => s.lang === lang);
  if (!found) throw new Error(`${op.operationId} has no ${lang} sample`);
  return found.source;
}

describe("x-codeSamples", () => {
  it("when the spec is bundled, then it has operations to check", () => {
    expect(operations.length).toBeGreaterThan(25);
  });

  it.each(operations.map((o) => [o.op.operationId!, o]))(
    "when %s is documented, then its curl sample calls its method and path",
    (_id, o) => {
      const curl = sample(o.op, "Shell");
      // `{model_id}` → any one segment; `/v1/models/{model}` takes a slash-separated id.
      const pattern = o.path
        .replace(/[.*+?^$()|[\]\\]/g, "\\$&")
        .replace(/\{model\}/g, "[^\\s?\"']+")
        .replace(/\{[a-z_]+\}/g, "[^/\\s?\"']+");
      expect(curl).toMatch(new RegExp(`curl [^\\n]*\\$ARBOR_BASE_URL${pattern}(?=[\\s?"'])`));
      if (o.method === "get") expect(curl).not.toMatch(/-X |-d |--data/);
      if (o.method === "post") expect(curl).toMatch(/-X POST|-d '|--data-binary @/);
      if (o.method === "delete") expect(curl).toMatch(/-X DELETE/);
    },
  );

  it("when the TypeScript samples are compiled against @arbor/client, then each type-checks", () => {
    const dir = join(root, "tests/contract/src/__samples__");
    const files = new Map(
      operations.map((o) => [
        join(dir, `${o.op.operationId}.ts`),
        `${PREAMBLE}${sample(o.op, "TypeScript")}\nexport {};\n`,
      ]),
    );
    const options: ts.CompilerOptions = {
      ...ts.parseJsonConfigFileContent(
        JSON.parse(readFileSync(join(root, "tsconfig.base.json"), "utf8")),
        ts.sys,
        root,
      ).options,
      noEmit: true,
      // As a consumer in a browser or any runtime: fetch and the DOM's types, none of Node's.
      lib: [
        "lib.es2024.d.ts",
        "lib.dom.d.ts",
        "lib.dom.iterable.d.ts",
        "lib.dom.asynciterable.d.ts",
      ],
      types: [],
    };
    const host = ts.createCompilerHost(options);
    const { getSourceFile, fileExists, readFile } = host;
    host.fileExists = (f) => files.has(f) || fileExists(f);
    host.readFile = (f) => files.get(f) ?? readFile(f);
    host.getSourceFile = (f, language, ...rest) => {
      const text = files.get(f);
      return text !== undefined
        ? ts.createSourceFile(f, text, language)
        : getSourceFile(f, language, ...rest);
    };
    host.directoryExists = (d) => d === dir || ts.sys.directoryExists(d);
    host.getCurrentDirectory = () => dirname(dir);
    const program = ts.createProgram([...files.keys()], options, host);
    const problems = ts
      .getPreEmitDiagnostics(program)
      .filter((d) => d.file && files.has(d.file.fileName))
      .map((d) => {
        const { line } = d.file!.getLineAndCharacterOfPosition(d.start ?? 0);
        const name = d.file!.fileName.slice(dir.length + 1);
        return `${name}:${line + 2 - PREAMBLE.split("\n").length}: ${ts.flattenDiagnosticMessageText(d.messageText, "\n")}`;
      });
    expect(problems).toEqual([]);
    // The check is real: a sample calling what the client lacks is reported.
    const broken = ts.createProgram(
      [join(dir, "broken.ts")],
      options,
      Object.assign(Object.create(host), {
        getSourceFile: (f: string, language: ts.ScriptTarget) =>
          f === join(dir, "broken.ts")
            ? ts.createSourceFile(
                f,
                `${PREAMBLE}await client.training.nope();\nexport {};\n`,
                language,
              )
            : host.getSourceFile(f, language),
        fileExists: (f: string) => f === join(dir, "broken.ts") || host.fileExists(f),
      }),
    );
    expect(ts.getPreEmitDiagnostics(broken).length).toBeGreaterThan(0);
  });
});
