#!/usr/bin/env node
import { run } from "./commands.ts";

run(process.argv.slice(2), {
  line: (text) => process.stdout.write(`${text}\n`),
  write: (text) => process.stdout.write(text),
  bar: process.stdout.isTTY ? (text) => process.stdout.write(`\r${text}`) : undefined,
  progress: { tty: process.stderr.isTTY === true, write: (text) => process.stderr.write(text) },
}).catch((err: unknown) => {
  process.stderr.write(`arbor: ${err instanceof Error ? err.message : String(err)}\n`);
  process.exit(1);
});
