#!/usr/bin/env node
import { existsSync, readFileSync } from "node:fs";
import { createInterface } from "node:readline/promises";
import { parseArgs } from "node:util";
import { createArborClient } from "@arbor/client";
import { adminKeyPath, type Config, readConfig } from "@arbor/config";
import { openStore } from "@arbor/store";
import { createKey, deletePrice, listKeys, listPrices, revokeKey, setPrice } from "./admin.ts";
import * as remote from "./remote.ts";

const usage = `arbor — Arbor's command line

  arbor keys create --user U --entity E [--name N]
  arbor keys list [--user U]
  arbor keys revoke <key prefix or id>
  arbor prices set --model M --prompt P --completion C [--project E/P] [--effective DATE]
                   [--cache-read X] [--cache-creation Y]     (prices are per token)
  arbor prices list [--project E/P] [--model M]   (defaults, plus the project's own)
  arbor prices delete <price id> [--project E/P]

  arbor models create --project P --name N [--base arbor/tiny-chat] [--entity E]
  arbor datasets upload FILE.jsonl [--name N]
  arbor train sft --model MODEL_ID --data FILE.jsonl|dataset://ID|https://… [--epochs N]
                  [--batch-size N|auto] [--lr X] [--checkpoint-every N] [--follow]
  arbor train rl --model MODEL_ID --groups GROUPS.json [--follow]
  arbor jobs get|cancel|follow JOB_ID
  arbor checkpoints list MODEL_ID
  arbor checkpoints delete MODEL_ID --steps 1,2
  arbor chat MODEL [--message TEXT] [--max-tokens N]   (no --message: a conversation on stdin)

Admin commands (keys, prices) open the store directly: ARBOR_DATA_DIR (default ~/.arbor) or
DATABASE_URL. The others call the server: ARBOR_BASE_URL (default http://127.0.0.1:8080),
ARBOR_API_KEY (default: the first-start key in ARBOR_DATA_DIR/admin.key), ARBOR_PROJECT.`;

const out = { line: (text: string) => process.stdout.write(`${text}\n`) };

async function main(argv: string[]): Promise<void> {
  const [group, command, ...rest] = argv;
  if (!group || group === "help" || group === "--help") {
    out.line(usage);
    return;
  }
  const { values, positionals } = parseArgs({
    args: rest,
    allowPositionals: true,
    options: {
      project: { type: "string" },
      base: { type: "string" },
      data: { type: "string" },
      groups: { type: "string" },
      epochs: { type: "string" },
      "batch-size": { type: "string" },
      lr: { type: "string" },
      "checkpoint-every": { type: "string" },
      follow: { type: "boolean" },
      steps: { type: "string" },
      message: { type: "string" },
      "max-tokens": { type: "string" },
      user: { type: "string" },
      entity: { type: "string" },
      name: { type: "string" },
      model: { type: "string" },
      prompt: { type: "string" },
      completion: { type: "string" },
      effective: { type: "string" },
      "cache-read": { type: "string" },
      "cache-creation": { type: "string" },
    },
  });
  const key = `${group} ${command ?? ""}`.trim();
  if (!["keys", "prices"].includes(group)) {
    await runRemote(key, group, command, values, positionals);
    return;
  }
  const config = readConfig();
  const store = await openStore({
    dataDir: config.dataDir,
    databaseUrl: config.databaseUrl,
    schema: config.databaseSchema,
  });
  try {
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

type Values = Record<string, string | boolean | undefined>;

/** The server the remote commands call: ARBOR_BASE_URL, or else where the server's own
 * ARBOR_HOST and ARBOR_PORT put it. */
export function serverUrl(config: Config): string {
  if (config.baseUrl) return config.baseUrl;
  const host = config.host === "0.0.0.0" || config.host === "::" ? "127.0.0.1" : config.host;
  return `http://${host.includes(":") ? `[${host}]` : host}:${config.port}`;
}

function remoteClient() {
  const config = readConfig();
  const keyFile = adminKeyPath(config.dataDir);
  const apiKey =
    config.apiKey ?? (existsSync(keyFile) ? readFileSync(keyFile, "utf8").trim() : undefined);
  return createArborClient({
    baseUrl: serverUrl(config),
    ...(apiKey ? { apiKey } : {}),
    ...(config.project ? { project: config.project } : {}),
  });
}

async function runRemote(
  key: string,
  group: string,
  command: string | undefined,
  values: Values,
  positionals: string[],
): Promise<void> {
  const client = remoteClient();
  const str = (name: string) =>
    typeof values[name] === "string" ? (values[name] as string) : undefined;
  const opt = (name: string) =>
    str(name) === undefined ? undefined : num(str(name)!, `--${name}`);
  const bar = process.stdout.isTTY
    ? (text: string) => process.stdout.write(`\r${text}`)
    : undefined;
  const follow = async (job: string) => {
    const last = await remote.followJob(
      client,
      { job },
      { line: (t) => out.line(bar ? `\n${t}` : t), ...(bar ? { bar } : {}) },
    );
    if (last?.type === "training_failed") process.exitCode = 1;
  };
  switch (key) {
    case "models create":
      await remote.createModel(
        client,
        {
          project: required(str("project"), "--project"),
          name: required(str("name"), "--name"),
          base: str("base") ?? "arbor/tiny-chat",
          entity: str("entity"),
        },
        out,
      );
      return;
    case "datasets upload":
      await remote.uploadDataset(
        client,
        { file: required(positionals[0], "FILE"), name: str("name") },
        out,
      );
      return;
    case "train sft": {
      const batch = str("batch-size");
      const job = await remote.trainSft(
        client,
        {
          model: required(str("model"), "--model"),
          data: required(str("data"), "--data"),
          epochs: opt("epochs"),
          batchSize:
            batch === "auto"
              ? "auto"
              : batch === undefined
                ? undefined
                : num(batch, "--batch-size"),
          learningRate: opt("lr"),
          checkpointEvery: opt("checkpoint-every"),
        },
        out,
      );
      if (values.follow) await follow(job);
      return;
    }
    case "train rl": {
      const job = await remote.trainRl(
        client,
        { model: required(str("model"), "--model"), groups: required(str("groups"), "--groups") },
        out,
      );
      if (values.follow) await follow(job);
      return;
    }
    case "jobs get":
      await remote.getJob(client, { job: required(positionals[0], "JOB_ID") }, out);
      return;
    case "jobs cancel":
      await remote.cancelJob(client, { job: required(positionals[0], "JOB_ID") }, out);
      return;
    case "jobs follow":
      await follow(required(positionals[0], "JOB_ID"));
      return;
    case "checkpoints list":
      await remote.listCheckpoints(client, { model: required(positionals[0], "MODEL_ID") }, out);
      return;
    case "checkpoints delete":
      await remote.deleteCheckpoints(
        client,
        {
          model: required(positionals[0], "MODEL_ID"),
          steps: required(str("steps"), "--steps")
            .split(",")
            .map((s) => num(s, "--steps")),
        },
        out,
      );
      return;
    default:
      if (group === "chat" && command) {
        await chatCommand(client, command, str("message"), opt("max-tokens"));
        return;
      }
      throw new Error(`Unknown command "${key}".\n\n${usage}`);
  }
}

/** One message, or a conversation read line by line from stdin. */
async function chatCommand(
  client: ReturnType<typeof remoteClient>,
  model: string,
  message: string | undefined,
  maxTokens: number | undefined,
): Promise<void> {
  const write = (text: string) => process.stdout.write(text);
  if (message !== undefined) {
    await remote.chat(
      client,
      { model, messages: [{ role: "user", content: message }], maxTokens },
      write,
    );
    write("\n");
    return;
  }
  const messages: { role: "user" | "assistant"; content: string }[] = [];
  const rl = createInterface({
    input: process.stdin,
    output: process.stdout,
    terminal: process.stdin.isTTY,
  });
  for (;;) {
    const line = await rl.question(process.stdin.isTTY ? "you> " : "").catch(() => undefined);
    if (line === undefined || line.trim() === "/exit") break;
    messages.push({ role: "user", content: line });
    if (process.stdin.isTTY) write("model> ");
    messages.push({
      role: "assistant",
      content: await remote.chat(client, { model, messages, maxTokens }, write),
    });
    write("\n");
  }
  rl.close();
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
