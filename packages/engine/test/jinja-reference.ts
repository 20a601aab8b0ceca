import { spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";

const script = fileURLToPath(new URL("./render_template.py", import.meta.url));

/** A Python with Jinja2 (`python3`, else Debian's with python3-jinja2), or undefined. */
function python(): string | undefined {
  for (const candidate of ["python3", "/usr/bin/python3"]) {
    const probe = spawnSync(candidate, ["-c", "import jinja2"], { stdio: "ignore" });
    if (probe.status === 0) return candidate;
  }
  return undefined;
}

export const referencePython = python();

/**
 * Renders each case with Jinja2 in Hugging Face transformers' environment (`render_template.py`):
 * the reference implementation chat templates are written for.
 */
export function renderWithJinja2(
  cases: readonly { template: string; context: Record<string, unknown> }[],
): ({ text: string } | { error: string })[] {
  if (!referencePython) throw new Error("no python3 with jinja2 (apt install python3-jinja2)");
  const result = spawnSync(referencePython, [script], {
    input: JSON.stringify(cases),
    encoding: "utf8",
    maxBuffer: 64 * 1024 * 1024,
  });
  if (result.status !== 0) throw new Error(`render_template.py failed: ${result.stderr}`);
  return JSON.parse(result.stdout) as ({ text: string } | { error: string })[];
}
