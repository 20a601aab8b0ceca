#!/usr/bin/env node
// The `arbor` command. Plain JavaScript, so that any Node can run this check: the CLI itself is
// TypeScript that Node runs as it is (type stripping) from Node 24 on.
const major = Number(process.versions.node.split(".")[0]);
if (major < 24) {
  process.stderr.write(
    `arbor: this command needs Node 24 or later; this is Node ${process.versions.node} (${process.execPath}).\n` +
      "Run it as ./scripts/arbor from the Arbor checkout (it uses the project's own Node 24 in .tools/),\n" +
      "or put Node 24 on your PATH.\n",
  );
  process.exit(1);
}
await import("../src/main.ts");
