import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { createInterface } from "node:readline/promises";
import { type ParseArgsOptionsConfig, parseArgs } from "node:util";
import {
  APIConnectionError,
  APIConnectionTimeoutError,
  type ArborClient,
  AuthenticationError,
  createArborClient,
} from "@arbor/client";
import {
  adminKeyPath,
  baseModelsDir,
  type Config,
  readConfig,
  storeOptionsOf,
} from "@arbor/config";
// Types only: the store (node:sqlite) and the engine (its WebAssembly) are imported when a
// command uses them, so that the remote commands load neither (and run on Node 20).
import type { Store } from "@arbor/store";
import pkg from "../package.json" with { type: "json" };
import {
  createKey,
  deletePrice,
  importBlobs,
  listKeys,
  listPrices,
  revokeKey,
  setPrice,
} from "./admin.ts";
import * as remote from "./remote.ts";

/** Where commands print. */
export interface Io {
  line(text: string): void;
  write(text: string): void;
  /** A line redrawn in place (a progress bar), on a terminal only. */
  bar?: ((text: string) => void) | undefined;
  /** Where a download's progress goes (stderr): redrawn in place on a terminal, else lines. */
  progress?: { tty: boolean; write(text: string): void } | undefined;
}

type Values<O extends ParseArgsOptionsConfig> = ReturnType<
  typeof parseArgs<{ options: O; allowPositionals: true; strict: true }>
>["values"];

/** What a command gets besides its arguments: output, and the store or the server, opened
 * on first use (so a command checks its arguments before it touches either). */
interface Env {
  io: Io;
  store: () => Promise<Store>;
  client: () => ArborClient;
}

/** A newer Node than the CLI's own floor (20) that a local command needs, and why. */
export interface NodeNeed {
  major: number;
  why: string;
}

/** The admin commands open the store, on node:sqlite: the server's own Node. */
const STORE: NodeNeed = { major: 24, why: "it opens the Arbor store with node:sqlite" };

interface CommandDef<O extends ParseArgsOptionsConfig> {
  /** `models create`, or `chat` (whose next word is a positional). */
  name: string;
  /** The arguments after the name, as `help` shows them. */
  usage: string;
  summary: string;
  /** Set on a local command that needs a newer Node than the remote ones. */
  needs?: NodeNeed;
  /** The command's own options; any other is refused. */
  options: O;
  run(ctx: Env & { values: Values<O>; positionals: string[] }): Promise<void>;
}

/** A command, its options parsed by its own table. */
export interface Command {
  name: string;
  usage: string;
  summary: string;
  needs?: NodeNeed | undefined;
  execute(args: readonly string[], env: Env): Promise<void>;
}

function command<const O extends ParseArgsOptionsConfig>(def: CommandDef<O>): Command {
  const { name, usage, summary, needs } = def;
  return {
    name,
    usage,
    summary,
    needs,
    execute(args, env) {
      let parsed: { values: Values<O>; positionals: string[] };
      try {
        parsed = parseArgs({
          args: [...args],
          options: def.options,
          allowPositionals: true,
          strict: true,
        });
      } catch (err) {
        const raw = (err as Error).message;
        const unknown = /Unknown option '(--?[^']+)'/.exec(raw)?.[1];
        const guess = unknown
          ? closest(unknown.replace(/^-+/, ""), Object.keys(def.options))
          : undefined;
        // Node's own text explains positionals after `--`; a person wants the option's name.
        const message = unknown
          ? `Unknown option ${unknown} for "arbor ${def.name}".${guess ? ` Did you mean --${guess}?` : ""}`
          : raw;
        throw new Error(`${message}\n\nUsage: ${commandHelp(def)}`);
      }
      return def.run({ ...env, ...parsed });
    },
  };
}

/** `train sft`'s passes over the data when `--epochs` is not given. */
const CLI_EPOCHS = 3;

const str = { type: "string" } as const;
const flag = { type: "boolean" } as const;

export const COMMANDS: readonly Command[] = [
  command({
    name: "keys create",
    needs: STORE,
    usage: "--user U --entity E [--name N] [--operator]",
    summary:
      "create an API key (and the user, and its membership of the entity); --operator: it may read /metrics",
    options: { user: str, entity: str, name: str, operator: flag },
    run: async ({ values, store, io }) => {
      const args = {
        user: required(values.user, "--user"),
        entity: required(values.entity, "--entity"),
        name: values.name,
        operator: values.operator,
      };
      await createKey(await store(), args, io);
    },
  }),
  command({
    name: "keys list",
    needs: STORE,
    usage: "[--user U]",
    summary: "list keys by prefix (never the key itself)",
    options: { user: str },
    run: ({ values, store, io }) => store().then((s) => listKeys(s, { user: values.user }, io)),
  }),
  command({
    name: "keys revoke",
    needs: STORE,
    usage: "KEY_PREFIX_OR_ID",
    summary: "revoke a key; it stops working on the next request",
    options: {},
    run: async ({ positionals, store, io }) => {
      const key = required(positionals[0], "KEY_PREFIX_OR_ID");
      await revokeKey(await store(), { key }, io);
    },
  }),
  command({
    name: "prices set",
    needs: STORE,
    usage:
      "--model M --prompt P --completion C [--project E/P] [--effective DATE] [--cache-read X] [--cache-creation Y]",
    summary: "set a model's price per token (the default, or a project's own)",
    options: {
      model: str,
      prompt: str,
      completion: str,
      project: str,
      effective: str,
      "cache-read": str,
      "cache-creation": str,
    },
    run: async ({ values, store, io }) => {
      const args = {
        model: required(values.model, "--model"),
        prompt: number(required(values.prompt, "--prompt"), "--prompt"),
        completion: number(required(values.completion, "--completion"), "--completion"),
        project: values.project,
        effective: values.effective,
        cacheRead: optionalNumber(values["cache-read"], "--cache-read"),
        cacheCreation: optionalNumber(values["cache-creation"], "--cache-creation"),
      };
      await setPrice(await store(), args, io);
    },
  }),
  command({
    name: "prices list",
    needs: STORE,
    usage: "[--project E/P] [--model M]",
    summary: "list prices: the defaults, plus the project's own",
    options: { project: str, model: str },
    run: async ({ values, store, io }) =>
      listPrices(await store(), { project: values.project, model: values.model }, io),
  }),
  command({
    name: "prices delete",
    needs: STORE,
    usage: "PRICE_ID [--project E/P]",
    summary: "delete a price",
    options: { project: str },
    run: async ({ values, positionals, store, io }) => {
      const args = { id: required(positionals[0], "PRICE_ID"), project: values.project };
      await deletePrice(await store(), args, io);
    },
  }),
  command({
    name: "blobs import",
    usage: "[--from DIR]",
    summary:
      "copy checkpoint and dataset files from a data directory (default ARBOR_DATA_DIR/blobs) into the store's blobs",
    needs: STORE,
    options: { from: str },
    run: async ({ values, store, io }) => {
      const from = values.from ?? join(readConfig().dataDir, "blobs");
      await importBlobs(await store(), { from }, io);
    },
  }),
  command({
    name: "models add-base",
    usage: "FOLDER [--id owner/name]",
    summary:
      "add a Hugging Face model folder as a base model (checked first; default id local/<folder>)",
    options: { id: str },
    run: async ({ values, positionals, io }) => {
      const config = readConfig();
      const { addBaseModel } = await import("./base-models.ts");
      await addBaseModel(
        {
          folder: required(positionals[0], "FOLDER"),
          id: values.id,
          modelsDir: baseModelsDir(config),
          weights: config.engineWeights,
        },
        io,
      );
    },
  }),
  command({
    name: "models pull",
    usage: `REPO[@REVISION] [--id owner/name]
  REPO is a Hugging Face Hub repo id (owner/name); REVISION a branch, tag or commit (default main).
  From HF_ENDPOINT (default https://huggingface.co), with HF_TOKEN for gated and private repos.`,
    summary:
      "download a model's config, tokenizer and safetensors from the Hugging Face Hub as a base model (checked first; resumable; default id: the repo's)",
    options: { id: str },
    run: async ({ values, positionals, io }) => {
      const config = readConfig();
      const { pullBaseModel } = await import("./base-models.ts");
      await pullBaseModel(
        {
          repo: required(positionals[0], "REPO"),
          id: values.id,
          modelsDir: baseModelsDir(config),
          endpoint: config.hfEndpoint,
          token: config.hfToken,
          weights: config.engineWeights,
        },
        io,
      );
    },
  }),
  command({
    name: "models create",
    usage: "--project P --name N [--base arbor/tiny-chat] [--entity E]",
    summary: "create a trainable model (or answer the existing one); prints its id",
    options: { project: str, name: str, base: str, entity: str },
    run: async ({ values, client, io }) => {
      await remote.createModel(
        client(),
        {
          project: required(values.project, "--project"),
          name: required(values.name, "--name"),
          base: values.base ?? "arbor/tiny-chat",
          entity: values.entity,
        },
        io,
      );
    },
  }),
  command({
    name: "models list",
    usage: "[--project P]",
    summary: "list your trained models, newest first: id, <entity>/<project>/<name>, base, step",
    options: { project: str },
    run: ({ values, client, io }) => remote.listModels(client(), { project: values.project }, io),
  }),
  command({
    name: "datasets upload",
    usage: "FILE.jsonl [--name N]",
    summary: "upload SFT data (or DPO pairs); prints its dataset:// URL",
    options: { name: str },
    run: async ({ values, positionals, client, io }) => {
      await remote.uploadDataset(
        client(),
        { file: required(positionals[0], "FILE.jsonl"), name: values.name },
        io,
      );
    },
  }),
  command({
    name: "train sft",
    usage: `--model MODEL --data FILE.jsonl|dataset://ID|https://… [--follow]
    [--validation FILE.jsonl|dataset://ID|https://…]
                            held-out examples, evaluated (loss, token accuracy) as training goes
    [--eval-every N]        validate every N steps (default: --checkpoint-every, else a tenth)
    [--epochs N]            passes over the data (default 3; a job sent without one is one pass)
    [--batch-size N|auto]   examples per optimizer step (server default: auto)
    [--lr X]                peak learning rate (server default: 3e-3 for base models under
                            100M parameters such as arbor/tiny-chat, 2e-4 from 100M)
    [--lr-schedule S]       constant | linear | cosine (server default cosine)
    [--warmup-steps N]      linear warm-up steps (default 0)
    [--assistant-turns T]   all | last: which assistant turns are trained (default all)
    [--method M]            sft | dpo: DPO trains on preference pairs (default sft; ADR 69)
    [--dpo-beta X]          DPO's beta (server default 0.1)
    [--checkpoint-every N]  a checkpoint every N steps (default: at the end)
    [--lora-rank N] [--lora-alpha N] [--max-seq-len N] [--max-grad-norm X]
    [--weight-decay X] [--seed N]   (experimental_config)
  MODEL is the model's id or <entity>/<project>/<name>; it is checked before anything is uploaded.`,
    summary: "start an SFT (or DPO) job (a local file is uploaded first)",
    options: {
      model: str,
      data: str,
      validation: str,
      "eval-every": str,
      epochs: str,
      "batch-size": str,
      lr: str,
      "lr-schedule": str,
      "warmup-steps": str,
      "assistant-turns": str,
      method: str,
      "dpo-beta": str,
      "checkpoint-every": str,
      "lora-rank": str,
      "lora-alpha": str,
      "max-seq-len": str,
      "max-grad-norm": str,
      "weight-decay": str,
      seed: str,
      follow: flag,
    },
    run: async ({ values, client, io }) => {
      const batch = values["batch-size"];
      const schedule = oneOf(values["lr-schedule"], "--lr-schedule", [
        "constant",
        "linear",
        "cosine",
      ] as const);
      const turns = oneOf(values["assistant-turns"], "--assistant-turns", ["all", "last"] as const);
      const method = oneOf(values.method, "--method", ["sft", "dpo"] as const);
      const job = await remote.trainSft(
        client(),
        {
          model: required(values.model, "--model"),
          data: required(values.data, "--data"),
          validation: values.validation,
          config: defined({
            // Sent explicitly: the API's default is one pass (its other clients run their own
            // epochs), while one pass over a small dataset teaches a person's job little.
            epochs: optionalNumber(values.epochs, "--epochs") ?? CLI_EPOCHS,
            batch_size: batch === "auto" ? "auto" : optionalNumber(batch, "--batch-size"),
            learning_rate: optionalNumber(values.lr, "--lr"),
            lr_schedule: schedule,
            warmup_steps: optionalNumber(values["warmup-steps"], "--warmup-steps"),
            assistant_turns: turns,
            method,
            dpo_beta: optionalNumber(values["dpo-beta"], "--dpo-beta"),
            checkpoint_every: optionalNumber(values["checkpoint-every"], "--checkpoint-every"),
            eval_every: optionalNumber(values["eval-every"], "--eval-every"),
          }),
          experimental: defined({
            lora_rank: optionalNumber(values["lora-rank"], "--lora-rank"),
            lora_alpha: optionalNumber(values["lora-alpha"], "--lora-alpha"),
            max_seq_len: optionalNumber(values["max-seq-len"], "--max-seq-len"),
            max_grad_norm: optionalNumber(values["max-grad-norm"], "--max-grad-norm"),
            weight_decay: optionalNumber(values["weight-decay"], "--weight-decay"),
            seed: optionalNumber(values.seed, "--seed"),
          }),
        },
        io,
      );
      if (values.follow) await follow(client(), job, io);
    },
  }),
  command({
    name: "train rl",
    usage:
      "--model MODEL --groups GROUPS.json [--follow]   (MODEL: id or <entity>/<project>/<name>)",
    summary: "start one RL step on trajectory groups",
    options: { model: str, groups: str, follow: flag },
    run: async ({ values, client, io }) => {
      const job = await remote.trainRl(
        client(),
        {
          model: required(values.model, "--model"),
          groups: required(values.groups, "--groups"),
        },
        io,
      );
      if (values.follow) await follow(client(), job, io);
    },
  }),
  command({
    name: "jobs get",
    usage: "JOB_ID",
    summary: "show a training job",
    options: {},
    run: ({ positionals, client, io }) =>
      remote.getJob(client(), { job: required(positionals[0], "JOB_ID") }, io),
  }),
  command({
    name: "jobs list",
    usage: "[--model MODEL] [--status queued|running|succeeded|failed|cancelled]",
    summary: "list your training jobs, newest first",
    options: { model: str, status: str },
    run: ({ values, client, io }) =>
      remote.listJobs(
        client(),
        {
          model: values.model,
          status: oneOf(values.status, "--status", [
            "queued",
            "running",
            "succeeded",
            "failed",
            "cancelled",
          ] as const),
        },
        io,
      ),
  }),
  command({
    name: "jobs cancel",
    usage: "JOB_ID",
    summary: "cancel a queued or running job",
    options: {},
    run: ({ positionals, client, io }) =>
      remote.cancelJob(client(), { job: required(positionals[0], "JOB_ID") }, io),
  }),
  command({
    name: "jobs follow",
    usage: "JOB_ID",
    summary: "follow a job's events with a progress bar, to its end",
    options: {},
    run: ({ positionals, client, io }) => follow(client(), required(positionals[0], "JOB_ID"), io),
  }),
  command({
    name: "checkpoints list",
    usage: "MODEL   (id or <entity>/<project>/<name>)",
    summary: "list a model's checkpoints with their metrics",
    options: {},
    run: ({ positionals, client, io }) =>
      remote.listCheckpoints(client(), { model: required(positionals[0], "MODEL") }, io),
  }),
  command({
    name: "checkpoints delete",
    usage: "MODEL --steps 1,2",
    summary: "delete checkpoints by step (not the latest)",
    options: { steps: str },
    run: ({ values, positionals, client, io }) =>
      remote.deleteCheckpoints(
        client(),
        {
          model: required(positionals[0], "MODEL"),
          steps: required(values.steps, "--steps")
            .split(",")
            .map((s) => number(s, "--steps")),
        },
        io,
      ),
  }),
  command({
    name: "checkpoints download",
    usage: "MODEL --step N [--format peft|gguf|gguf-lora] [--outtype f32|q8_0] -o FILE",
    summary:
      "download a checkpoint: its adapter (PEFT's files in a tar, or a llama.cpp LoRA GGUF) or a merged GGUF (F32, or Q8_0 with --outtype q8_0)",
    options: { step: str, format: str, outtype: str, output: { ...str, short: "o" } },
    run: ({ values, positionals, client, io }) => {
      const format = values.format ?? "peft";
      if (format !== "peft" && format !== "gguf" && format !== "gguf-lora")
        throw new Error(`--format must be peft, gguf or gguf-lora, got "${format}".`);
      const outtype = values.outtype;
      if (outtype !== undefined && outtype !== "f32" && outtype !== "q8_0")
        throw new Error(`--outtype must be f32 or q8_0, got "${outtype}".`);
      return remote.downloadCheckpoint(
        client(),
        {
          model: required(positionals[0], "MODEL"),
          step: number(required(values.step, "--step"), "--step"),
          format,
          ...(outtype ? { outtype } : {}),
          file: required(values.output, "-o FILE"),
        },
        io,
      );
    },
  }),
  command({
    name: "checkpoints upload",
    usage: "MODEL ADAPTER_DIR|ADAPTER.tar",
    summary: "add a PEFT LoRA adapter trained elsewhere as the model's next step",
    options: {},
    run: ({ positionals, client, io }) =>
      remote.uploadCheckpoint(
        client(),
        {
          model: required(positionals[0], "MODEL"),
          path: required(positionals[1], "ADAPTER_DIR|ADAPTER.tar"),
        },
        io,
      ),
  }),
  command({
    name: "chat",
    usage: `MODEL [--message TEXT]   (no --message: a conversation on stdin)
    [--temperature X]  sampling temperature; default 0 (deterministic) for a trained model or
                       checkpoint, the server's default (1) for a base model
    [--top-p X] [--max-tokens N] [--seed N]`,
    summary: "chat with a base model, a trained model or a checkpoint (…:stepN)",
    options: { message: str, "max-tokens": str, temperature: str, "top-p": str, seed: str },
    run: ({ values, positionals, client, io }) => {
      const model = required(positionals[0], "MODEL");
      // A trained model (`<entity>/<project>/<name>[:stepN]`) answers deterministically by
      // default, so a smoke test after training shows what it learned, not sampling noise.
      const trained = model.split("/").length === 3;
      return chat(
        client(),
        model,
        values.message,
        {
          maxTokens: optionalNumber(values["max-tokens"], "--max-tokens"),
          temperature:
            optionalNumber(values.temperature, "--temperature") ?? (trained ? 0 : undefined),
          topP: optionalNumber(values["top-p"], "--top-p"),
          seed: optionalNumber(values.seed, "--seed"),
        },
        io,
      );
    },
  }),
];

/** `arbor help`: every command, one line each, and where the CLI finds the store and server. */
export function helpText(): string {
  const width = Math.max(...COMMANDS.map((c) => c.name.length));
  const lines = COMMANDS.map((c) => `  arbor ${c.name.padEnd(width)}  ${c.summary}`);
  return `arbor — Arbor's command line

${lines.join("\n")}

Run "arbor help COMMAND" (or "arbor COMMAND --help") for a command's options.

Admin commands (keys, prices, blobs) open the store directly, on Node 24 or later: ARBOR_DATA_DIR
(default ~/.arbor) or DATABASE_URL. "models add-base" and "models pull" write to this machine's
ARBOR_BASE_MODELS_DIR (default ARBOR_DATA_DIR/models); pull reads HF_ENDPOINT and HF_TOKEN. The others call the server, on Node 20 or later: ARBOR_BASE_URL (default http://ARBOR_HOST:ARBOR_PORT,
that is http://127.0.0.1:8080), ARBOR_API_KEY (default: the first-start key in
ARBOR_DATA_DIR/admin.key), ARBOR_PROJECT.`;
}

function commandHelp(c: Pick<Command, "name" | "usage" | "summary">): string {
  return `arbor ${c.name} ${c.usage}\n\n  ${c.summary}`;
}

/** The command named by the first words of `argv`, and the rest. */
function findCommand(argv: readonly string[]): { command: Command; rest: string[] } | undefined {
  for (const words of [2, 1]) {
    const name = argv.slice(0, words).join(" ");
    const command = COMMANDS.find((c) => c.name === name);
    if (command) return { command, rest: argv.slice(words) };
  }
  return undefined;
}

/** Runs the command line `argv` (without `node` and the script). */
export async function run(argv: readonly string[], io: Io): Promise<void> {
  if (argv[0] === "--version" || argv[0] === "-v" || argv[0] === "version") {
    io.line(`arbor ${pkg.version}`);
    return;
  }
  if (argv.length === 0 || argv[0] === "help" || argv[0] === "--help" || argv[0] === "-h") {
    const found = argv[0] === "help" ? findCommand(argv.slice(1)) : undefined;
    io.line(found ? commandHelp(found.command) : helpText());
    return;
  }
  const found = findCommand(argv);
  if (!found) {
    const typed = argv.slice(0, 2).join(" ");
    const guess = closest(
      typed,
      COMMANDS.map((c) => c.name),
    );
    throw new Error(
      `Unknown command "${typed}".${guess ? ` Did you mean "arbor ${guess}"?` : ""}\n\n${helpText()}`,
    );
  }
  const { command, rest } = found;
  if (rest.includes("--help") || rest.includes("-h")) {
    io.line(commandHelp(command));
    return;
  }
  checkNode(command, process.versions.node);
  const config = readConfig();
  let opened: Store | undefined;
  try {
    await command.execute(rest, {
      io,
      store: async () => {
        const { openStore } = await import("@arbor/store");
        opened ??= await openStore(storeOptionsOf(config));
        return opened;
      },
      client: () => remoteClient(config),
    });
  } catch (err) {
    throw explain(err, config);
  } finally {
    await opened?.close();
  }
}

/**
 * Refuses, in one line, a command that needs a newer Node than `version` (the installed
 * package runs on Node 20; its admin commands do not).
 */
export function checkNode(command: Pick<Command, "name" | "needs">, version: string): void {
  const need = command.needs;
  if (!need || Number(version.split(".")[0]) >= need.major) return;
  throw new Error(
    `"arbor ${command.name}" needs Node ${need.major} or later (${need.why}); this is Node ${version}. ` +
      "The server commands (models, datasets, train, jobs, checkpoints, chat) run on Node 20 and later.",
  );
}

/** The server the remote commands call: ARBOR_BASE_URL, or else where the server's own
 * ARBOR_HOST and ARBOR_PORT put it. */
export function serverUrl(config: Config): string {
  if (config.baseUrl) return config.baseUrl;
  const host = config.host === "0.0.0.0" || config.host === "::" ? "127.0.0.1" : config.host;
  return `http://${host.includes(":") ? `[${host}]` : host}:${config.port}`;
}

/** Where the remote commands' key comes from, for error messages. */
function keySource(config: Config): { apiKey?: string; from: string } {
  if (config.apiKey) return { apiKey: config.apiKey, from: "ARBOR_API_KEY" };
  const keyFile = adminKeyPath(config.dataDir);
  if (existsSync(keyFile)) return { apiKey: readFileSync(keyFile, "utf8").trim(), from: keyFile };
  return { from: keyFile };
}

/** A connection or key problem, said in terms of what to change. */
function explain(err: unknown, config: Config): unknown {
  if (err instanceof APIConnectionTimeoutError) {
    return new Error(
      `The Arbor server at ${serverUrl(config)} did not answer in time (${err.message}). Is it overloaded, or is ARBOR_BASE_URL pointing at something else?`,
    );
  }
  if (err instanceof APIConnectionError) {
    return new Error(
      `Could not reach the Arbor server at ${serverUrl(config)} (${rootCause(err)}). ` +
        "Start it with ./scripts/serve, or point the CLI at it with ARBOR_BASE_URL (or the server's ARBOR_HOST and ARBOR_PORT).",
    );
  }
  if (err instanceof AuthenticationError) {
    const { apiKey, from } = keySource(config);
    return new Error(
      apiKey
        ? `The server at ${serverUrl(config)} refused the API key from ${from} (${err.message.replace(/\.$/, "")}). Set ARBOR_API_KEY to a valid key (arbor keys create).`
        : `No API key: ARBOR_API_KEY is not set and ${from} does not exist. Set ARBOR_API_KEY, or ARBOR_DATA_DIR to the server's data directory (its first start writes admin.key there).`,
    );
  }
  return err;
}

/** The innermost cause's message: fetch wraps ECONNREFUSED and the like in "fetch failed". */
function rootCause(err: Error): string {
  let cause: unknown = err;
  while (cause instanceof Error && cause.cause instanceof Error) cause = cause.cause;
  const e = cause as NodeJS.ErrnoException;
  return e.code && !e.message.includes(e.code) ? `${e.code}: ${e.message}` : e.message;
}

/** The candidate nearest to `typed` by edit distance, if it is near enough to be a typo. */
export function closest(typed: string, candidates: readonly string[]): string | undefined {
  let best: string | undefined;
  let bestDistance = Number.POSITIVE_INFINITY;
  for (const c of candidates) {
    const d = editDistance(typed, c);
    if (d < bestDistance) [best, bestDistance] = [c, d];
  }
  return bestDistance <= Math.max(2, Math.floor(typed.length / 3)) ? best : undefined;
}

function editDistance(a: string, b: string): number {
  let previous = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const current = [i];
    for (let j = 1; j <= b.length; j++) {
      current[j] = Math.min(
        previous[j]! + 1,
        current[j - 1]! + 1,
        previous[j - 1]! + (a[i - 1] === b[j - 1] ? 0 : 1),
      );
    }
    previous = current;
  }
  return previous[b.length]!;
}

function remoteClient(config: Config): ArborClient {
  const { apiKey } = keySource(config);
  return createArborClient({
    baseUrl: serverUrl(config),
    ...(apiKey ? { apiKey } : {}),
    ...(config.project ? { project: config.project } : {}),
  });
}

/** What Ctrl-C while following says: the job is the server's, and goes on. */
export function stoppedFollowing(job: string): string {
  return `Stopped following. Job ${job} keeps running on the server: "arbor jobs follow ${job}" to watch it again, "arbor jobs cancel ${job}" to stop it.`;
}

async function follow(client: ArborClient, job: string, io: Io): Promise<void> {
  // Ctrl-C ends this command, not the job: say so, and how to come back to it or stop it.
  const interrupted = () => {
    process.stderr.write(`${io.bar ? "\n" : ""}${stoppedFollowing(job)}\n`);
    process.exit(130);
  };
  process.once("SIGINT", interrupted);
  const last = await remote
    .followJob(
      client,
      { job },
      { line: (t) => io.line(io.bar ? `\n${t}` : t), ...(io.bar ? { bar: io.bar } : {}) },
    )
    .finally(() => process.off("SIGINT", interrupted));
  // A cancelled job ended as asked: only a failure is an error.
  if (
    last?.type === "training_failed" &&
    (last.data as { error_message?: unknown }).error_message !== "cancelled"
  )
    process.exitCode = 1;
}

/** One message, or a conversation read line by line from stdin. */
async function chat(
  client: ArborClient,
  model: string,
  message: string | undefined,
  sampling: Pick<remote.ChatArgs, "maxTokens" | "temperature" | "topP" | "seed">,
  io: Io,
): Promise<void> {
  if (message !== undefined) {
    await remote.chat(
      client,
      { model, messages: [{ role: "user", content: message }], ...sampling },
      io.write,
    );
    io.write("\n");
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
    if (process.stdin.isTTY) io.write("model> ");
    messages.push({
      role: "assistant",
      content: await remote.chat(client, { model, messages, ...sampling }, io.write),
    });
    io.write("\n");
  }
  rl.close();
}

function oneOf<const T extends string>(
  value: string | undefined,
  name: string,
  allowed: readonly T[],
): T | undefined {
  if (value === undefined) return undefined;
  if (!(allowed as readonly string[]).includes(value))
    throw new Error(`${name} must be one of ${allowed.join(", ")}, got "${value}".`);
  return value as T;
}

/** The object without its undefined properties. */
function defined<T extends Record<string, unknown>>(
  object: T,
): { [K in keyof T]: Exclude<T[K], undefined> } {
  return Object.fromEntries(Object.entries(object).filter(([, v]) => v !== undefined)) as never;
}

function required(value: string | undefined, name: string): string {
  if (value === undefined || value === "") throw new Error(`${name} is required.`);
  return value;
}

function number(value: string, name: string): number {
  const n = Number(value);
  if (value.trim() === "" || !Number.isFinite(n) || n < 0)
    throw new Error(`${name} must be a non-negative number, got "${value}".`);
  return n;
}

function optionalNumber(value: string | undefined, name: string): number | undefined {
  return value === undefined ? undefined : number(value, name);
}
