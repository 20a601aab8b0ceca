import { readFileSync } from "node:fs";
import { join } from "node:path";
import ts from "typescript";
import { describe, expect, it } from "vitest";

/**
 * A job's events are a union by `type`, so code that narrows on it reads typed `data` under
 * `tsc --strict`, as a user's code would, and code that does not is told so.
 */
const src = import.meta.dirname;
const root = join(src, "../../..");

function diagnostics(code: string): string[] {
  const file = join(src, "__typed-events__.ts");
  const options: ts.CompilerOptions = {
    ...ts.parseJsonConfigFileContent(
      JSON.parse(readFileSync(join(root, "tsconfig.base.json"), "utf8")),
      ts.sys,
      root,
    ).options,
    strict: true,
    noEmit: true,
    types: [],
    lib: ["lib.es2024.d.ts", "lib.dom.d.ts", "lib.dom.asynciterable.d.ts"],
  };
  const host = ts.createCompilerHost(options);
  const { getSourceFile, fileExists } = host;
  host.fileExists = (f) => f === file || fileExists(f);
  host.getSourceFile = (f, language, ...rest) =>
    f === file ? ts.createSourceFile(f, code, language) : getSourceFile(f, language, ...rest);
  const program = ts.createProgram([file], options, host);
  return ts
    .getPreEmitDiagnostics(program)
    .filter((d) => d.file?.fileName === file)
    .map((d) => ts.flattenDiagnosticMessageText(d.messageText, "\n"));
}

const PREAMBLE = `import { createArborClient } from "./index.ts";
const client = createArborClient({ baseUrl: "http://127.0.0.1:8080", apiKey: "sk" });
const lines: string[] = [];
`;

describe("TrainingJobEvent", () => {
  it("when code narrows an event on its type, then its data type-checks under tsc --strict", () => {
    expect(
      diagnostics(`${PREAMBLE}
for await (const event of client.training.jobs.events.follow("job")) {
  if (event.type === "gradient_step") {
    lines.push(\`step \${event.data.gradient_step}: loss \${event.data.loss?.toFixed(3)}\`);
    lines.push(event.data.reward?.toFixed(3) ?? "");
  } else if (event.type === "validation") {
    lines.push(\`validation after \${event.data.gradient_step}: \${event.data.loss?.toFixed(3)}\`);
    lines.push(event.data.mean_token_accuracy?.toFixed(2) ?? "", String(event.data.num_examples));
  } else if (event.type === "training_started") {
    lines.push(\`\${event.data.num_sequences} steps\`, String(event.data.resumed_from_step ?? 0));
  } else if (event.type === "checkpoint_saved") {
    lines.push(event.data.step.toFixed(0));
  } else if (event.type === "training_failed") {
    lines.push(event.data.error_message.toUpperCase());
  }
}
export {};
`),
    ).toEqual([]);
  });

  it("when code reads a type's data without narrowing, or a field its type lacks, then tsc says so", () => {
    const problems = diagnostics(`${PREAMBLE}
for await (const event of client.training.jobs.events.follow("job")) {
  lines.push(event.data.loss.toFixed(3));
  if (event.type === "checkpoint_saved") lines.push(event.data.error_message.toUpperCase());
}
export {};
`);
    expect(problems).toHaveLength(2);
    expect(problems[0]).toMatch(
      /Property 'loss' does not exist|'event\.data\.loss' is of type 'unknown'/,
    );
    expect(problems[1]).toMatch(/'event\.data\.error_message' is of type 'unknown'/);
  });
});
