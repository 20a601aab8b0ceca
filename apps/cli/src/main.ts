#!/usr/bin/env node
import { run } from "./commands.ts";

// `arbor jobs list | head -1`: a reader that went away wants no more output, which is no error.
for (const stream of [process.stdout, process.stderr]) {
  stream.on("error", (err: NodeJS.ErrnoException) => {
    if (err.code === "EPIPE") process.exit(0);
    throw err;
  });
}

run(process.argv.slice(2), {
  line: (text) => process.stdout.write(`${text}\n`),
  write: (text) => process.stdout.write(text),
  bar: process.stdout.isTTY ? (text) => process.stdout.write(`\r${text}`) : undefined,
  progress: { tty: process.stderr.isTTY === true, write: (text) => process.stderr.write(text) },
}).catch((err: unknown) => {
  process.stderr.write(`arbor: ${err instanceof Error ? err.message : String(err)}\n`);
  process.exit(1);
});
