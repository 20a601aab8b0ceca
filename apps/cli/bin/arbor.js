#!/usr/bin/env node
// The `arbor` command: the bundle in ../dist (ADR 42), built by `pnpm --filter @arbor/cli build`.
// Plain JavaScript that any Node reads, so that an older one is told which Node the CLI needs.
const NEED = 20;
const major = Number(process.versions.node.split(".")[0]);
if (major < NEED) {
  process.stderr.write(
    `arbor: this command needs Node ${NEED} or later; this is Node ${process.versions.node} (${process.execPath}).\n`,
  );
  process.exit(1);
}
const bundle = new URL("../dist/arbor.js", import.meta.url);
// No syntax newer than Node 14's here (no `?.` even), so that the check above is reached.
import(bundle.href).catch((err) => {
  const error = err instanceof Error ? err : new Error(String(err));
  if (
    error.code === "ERR_MODULE_NOT_FOUND" &&
    error.message.includes(decodeURIComponent(bundle.pathname))
  ) {
    // A checkout that was not built: the installed package always holds dist/.
    process.stderr.write(
      "arbor: the CLI is not built: run `pnpm --filter @arbor/cli build`, or ./scripts/arbor from the Arbor checkout.\n",
    );
  } else {
    process.stderr.write(`arbor: ${error.stack}\n`);
  }
  process.exit(1);
});
