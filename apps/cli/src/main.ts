#!/usr/bin/env node
import { homedir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { serve } from "@arbor/server";
import { openStore } from "@arbor/store";
import { createKey, deletePrice, listKeys, listPrices, revokeKey, setPrice } from "./admin.ts";

const usage = `arbor — Arbor's command line

  arbor serve                                  run the server (same as ./scripts/serve)
  arbor keys create --user U --entity E [--name N]
  arbor keys list [--user U]
  arbor keys revoke <key prefix or id>
  arbor prices set --model M --prompt P --completion C [--project E/P] [--effective DATE]
                   [--cache-read X] [--cache-creation Y]     (prices are per token)
  arbor prices list [--project E/P] [--model M]   (defaults, plus the project's own)
  arbor prices delete <price id> [--project E/P]

Admin commands open the store directly: ARBOR_DATA_DIR (default ~/.arbor) or DATABASE_URL.`;

const out = { line: (text: string) => process.stdout.write(`${text}\n`) };

async function main(argv: string[]): Promise<void> {
  const [group, command, ...rest] = argv;
  if (group === "serve") {
    await serve();
    return;
  }
  if (!group || group === "help" || group === "--help") {
    out.line(usage);
    return;
  }
  const { values, positionals } = parseArgs({
    args: rest,
    allowPositionals: true,
    options: {
      user: { type: "string" },
      entity: { type: "string" },
      name: { type: "string" },
      model: { type: "string" },
      project: { type: "string" },
      prompt: { type: "string" },
      completion: { type: "string" },
      effective: { type: "string" },
      "cache-read": { type: "string" },
      "cache-creation": { type: "string" },
    },
  });
  const store = await openStore({
    dataDir: process.env.ARBOR_DATA_DIR ?? join(homedir(), ".arbor"),
    databaseUrl: process.env.DATABASE_URL || undefined,
  });
  try {
    const key = `${group} ${command ?? ""}`.trim();
    switch (key) {
      case "keys create":
        await createKey(
          store,
          {
            user: required(values.user, "--user"),
            entity: required(values.entity, "--entity"),
            name: values.name,
          },
          out,
        );
        break;
      case "keys list":
        await listKeys(store, { user: values.user }, out);
        break;
      case "keys revoke":
        await revokeKey(store, { key: required(positionals[0], "<key prefix or id>") }, out);
        break;
      case "prices set":
        await setPrice(
          store,
          {
            model: required(values.model, "--model"),
            prompt: num(required(values.prompt, "--prompt"), "--prompt"),
            completion: num(required(values.completion, "--completion"), "--completion"),
            project: values.project,
            effective: values.effective,
            cacheRead:
              values["cache-read"] === undefined
                ? undefined
                : num(values["cache-read"], "--cache-read"),
            cacheCreation:
              values["cache-creation"] === undefined
                ? undefined
                : num(values["cache-creation"], "--cache-creation"),
          },
          out,
        );
        break;
      case "prices list":
        await listPrices(store, { project: values.project, model: values.model }, out);
        break;
      case "prices delete":
        await deletePrice(
          store,
          { id: required(positionals[0], "<price id>"), project: values.project },
          out,
        );
        break;
      default:
        throw new Error(`Unknown command "${key}".\n\n${usage}`);
    }
  } finally {
    await store.close();
  }
}

function required(value: string | undefined, name: string): string {
  if (value === undefined || value === "") throw new Error(`${name} is required.`);
  return value;
}

function num(value: string, name: string): number {
  const n = Number(value);
  if (!Number.isFinite(n) || n < 0)
    throw new Error(`${name} must be a non-negative number, got "${value}".`);
  return n;
}

main(process.argv.slice(2)).catch((err: unknown) => {
  process.stderr.write(`arbor: ${err instanceof Error ? err.message : String(err)}\n`);
  process.exit(1);
});
