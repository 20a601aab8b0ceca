import { createHash } from "node:crypto";
import { createWriteStream, existsSync, readFileSync } from "node:fs";
import { rename, rm, stat } from "node:fs/promises";
import { join } from "node:path";
import { Readable } from "node:stream";
import { pipeline } from "node:stream/promises";
import type { ArborClient, Model, TrainingJob, TrainingJobEvent } from "@arbor/client";
import tar from "tar-stream";
import type { Output } from "./admin.ts";

/** The commands that talk to a running server through @arbor/client. */

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

/**
 * A model as a person types it: its id, or `<entity>/<project>/<name>`. Resolved before any
 * side effect (an upload, a job), so a typo costs nothing.
 */
export async function resolveModel(client: ArborClient, ref: string): Promise<Model> {
  const byId = UUID.test(ref);
  // A name pages only through its own project's models.
  const project = byId ? undefined : ref.split("/")[1];
  if (project !== undefined && !/^[A-Za-z0-9._-]+$/.test(project))
    throw new Error(`"${ref}" is neither a model id nor <entity>/<project>/<name>.`);
  for await (const model of client.training.models.list({
    limit: 100,
    ...(project ? { project } : {}),
  })) {
    if (byId ? model.id === ref : `${model.entity}/${model.project}/${model.name}` === ref)
      return model;
  }
  throw new Error(
    `No trained model "${ref}" for this key: give its id or <entity>/<project>/<name> (see "arbor models list").`,
  );
}

/**
 * A table: its header once the first page has arrived, so that a refused request (a wrong key)
 * prints its error alone, then a line per row.
 */
async function table<T>(
  out: Output,
  header: readonly string[],
  rows: AsyncIterable<T>,
  row: (item: T) => readonly unknown[],
): Promise<void> {
  const iterator = rows[Symbol.asyncIterator]();
  let next = await iterator.next();
  out.line(header.join("\t"));
  for (; !next.done; next = await iterator.next()) out.line(row(next.value).join("\t"));
}

/** `arbor models list`: the key's trained models, newest first. */
export async function listModels(
  client: ArborClient,
  args: { project?: string | undefined },
  out: Output,
): Promise<void> {
  await table(
    out,
    ["id", "model", "base", "latest step", "created"],
    client.training.models.list({
      limit: 100,
      ...(args.project ? { project: args.project } : {}),
    }),
    (m) => [
      m.id,
      `${m.entity}/${m.project}/${m.name}`,
      m.base_model,
      m.latest_step,
      new Date(m.created_at * 1000).toISOString(),
    ],
  );
}

/** `arbor jobs list`: the key's jobs, newest first, of one model or status. */
export async function listJobs(
  client: ArborClient,
  args: { model?: string | undefined; status?: TrainingJob["status"] | undefined },
  out: Output,
): Promise<void> {
  const model = args.model ? await resolveModel(client, args.model) : undefined;
  await table(
    out,
    ["id", "type", "model", "status", "steps", "created"],
    client.training.jobs.list({
      limit: 100,
      ...(model ? { model_id: model.id } : {}),
      ...(args.status ? { status: args.status } : {}),
    }),
    (j) => [
      j.id,
      j.type,
      j.model_id,
      j.status,
      `${j.step_from}→${j.step_to ?? "…"}`,
      new Date(j.created_at * 1000).toISOString(),
    ],
  );
}

/**
 * A file a command was given, read; a missing, unreadable or empty one is said in words
 * rather than as Node's `ENOENT` (or, for an empty dataset, the server's "body is empty").
 */
export function readInput(file: string, what: string): Buffer {
  let bytes: Buffer;
  try {
    bytes = readFileSync(file);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    const why =
      code === "ENOENT"
        ? "there is no such file"
        : code === "EISDIR"
          ? "it is a folder, not a file"
          : code === "EACCES" || code === "EPERM"
            ? "permission denied"
            : (err as Error).message;
    throw new Error(`Cannot read ${what} ${file}: ${why}.`);
  }
  if (bytes.length === 0)
    throw new Error(`${what[0]!.toUpperCase()}${what.slice(1)} ${file} is empty.`);
  return bytes;
}

export async function uploadDataset(
  client: ArborClient,
  args: { file: string; name?: string | undefined },
  out: Output,
): Promise<string> {
  const text = readInput(args.file, "the dataset").toString("utf8");
  if (text.trim() === "")
    throw new Error(
      `The dataset ${args.file} holds only blank lines: it needs one JSON example a line ({"messages": [...]}).`,
    );
  const dataset = await client.training.datasets.create(text, args.name ? { name: args.name } : {});
  out.line(`Uploaded ${dataset.lines} lines (${dataset.bytes} bytes): ${dataset.url}`);
  return dataset.url;
}

export async function createModel(
  client: ArborClient,
  args: { project: string; name: string; base: string; entity?: string | undefined },
  out: Output,
): Promise<string> {
  const model = await client.training.models.create({
    entity: args.entity ?? null,
    project: args.project,
    name: args.name,
    base_model: args.base,
    return_existing: true,
  });
  out.line(
    `Model ${model.id}: ${model.entity}/${model.project}/${model.name} (base ${model.base_model}, step ${model.latest_step})`,
  );
  return model.id;
}

type Sft = Parameters<ArborClient["training"]["jobs"]["createSft"]>[0];

export interface SftArgs {
  /** The model's id or `<entity>/<project>/<name>`. */
  model: string;
  data: string;
  /** Held-out examples: a file (uploaded first) or a `dataset://` or `https://` URL. */
  validation?: string | undefined;
  /** `SftConfig` fields as given (unset ones take the server's defaults). */
  config?: NonNullable<Sft["config"]>;
  experimental?: NonNullable<Sft["experimental_config"]>;
}

export async function trainSft(client: ArborClient, args: SftArgs, out: Output): Promise<string> {
  const model = await resolveModel(client, args.model);
  const dataUrl = async (data: string) =>
    /^(dataset|https):\/\//.test(data) ? data : await uploadDataset(client, { file: data }, out);
  const url = await dataUrl(args.data);
  const validation = args.validation === undefined ? undefined : await dataUrl(args.validation);
  const job = await client.training.jobs.createSft({
    model_id: model.id,
    training_data_url: url,
    ...(validation ? { validation_data_url: validation } : {}),
    config: args.config ?? {},
    ...(args.experimental && Object.keys(args.experimental).length
      ? { experimental_config: args.experimental }
      : {}),
  });
  out.line(`${args.config?.method === "dpo" ? "DPO" : "SFT"} job ${job.id} ${job.status}.`);
  return job.id;
}

export async function trainRl(
  client: ArborClient,
  args: { model: string; groups: string },
  out: Output,
): Promise<string> {
  const model = await resolveModel(client, args.model);
  const text = readInput(args.groups, "the trajectory groups file").toString("utf8");
  let groups: unknown;
  try {
    groups = JSON.parse(text);
  } catch (err) {
    throw new Error(
      `The trajectory groups file ${args.groups} is not JSON: ${(err as Error).message}`,
    );
  }
  const job = await client.training.jobs.createRl({
    model_id: model.id,
    trajectory_groups: (Array.isArray(groups) ? groups : [groups]) as never,
  });
  out.line(`RL job ${job.id} ${job.status}.`);
  return job.id;
}

export async function getJob(
  client: ArborClient,
  args: { job: string },
  out: Output,
): Promise<void> {
  const job = await client.training.jobs.retrieve(args.job);
  out.line(JSON.stringify(job, null, 2));
}

export async function cancelJob(
  client: ArborClient,
  args: { job: string },
  out: Output,
): Promise<void> {
  const job = await client.training.jobs.cancel(args.job);
  out.line(`Job ${job.id} ${job.status}.`);
}

/** Draws a progress bar with the loss from the job's events, says where a resumed job went on,
 * and ends with its terminal event. */
export async function followJob(
  client: ArborClient,
  args: { job: string },
  out: Output & { bar?: (text: string) => void },
): Promise<TrainingJobEvent | undefined> {
  let total = 0;
  let last: TrainingJobEvent | undefined;
  // Checkpoints are named by the model's step, which counts on from its earlier jobs; the
  // progress counts this job's steps. A checkpoint is told in both.
  const { step_from: stepFrom } = await client.training.jobs.retrieve(args.job);
  for await (const event of client.training.jobs.events.follow(args.job)) {
    last = event;
    const data = event.data as Record<string, unknown>;
    if (event.type === "training_started") {
      total = Number(data.num_sequences ?? 0);
      // A later run of the job (its worker died): it goes on after this step; the steps an
      // earlier run reported are not reported again.
      if (typeof data.resumed_from_step === "number")
        out.line(
          `Resumed from step ${data.resumed_from_step} of ${total}${typeof data.attempt === "number" ? ` (attempt ${data.attempt})` : ""}.`,
        );
      else out.line(`Training started: ${total} step${total === 1 ? "" : "s"}.`);
    } else if (event.type === "gradient_step") {
      const step = Number(data.gradient_step ?? 0);
      const line = `${progressBar(step, total)} step ${step}/${total}  loss ${Number(data.loss).toFixed(4)}${typeof data.reward === "number" ? `  reward ${data.reward.toFixed(3)}` : ""}`;
      if (out.bar) out.bar(line);
      else out.line(line);
    } else if (event.type === "validation") {
      const step = Number(data.gradient_step ?? 0);
      const accuracy = data.mean_token_accuracy;
      out.line(
        `Validation at step ${step}${total ? `/${total}` : ""}: loss ${Number(data.loss).toFixed(4)}${typeof accuracy === "number" ? `  token accuracy ${(accuracy * 100).toFixed(1)}%` : ""} (${String(data.num_examples)} examples)`,
      );
    } else if (event.type === "checkpoint_saved") {
      const step = Number(data.step);
      out.line(
        `Checkpoint saved at step ${step - stepFrom}${total ? `/${total}` : ""}${stepFrom ? ` (the model's step ${step})` : ""}.`,
      );
    } else if (event.type === "training_ended") {
      out.line("Training ended.");
    } else if (event.type === "training_failed") {
      out.line(
        data.error_message === "cancelled"
          ? "Training cancelled."
          : `Training failed: ${String(data.error_message)}`,
      );
    }
  }
  return last;
}

export function progressBar(done: number, total: number, width = 24): string {
  const filled = total > 0 ? Math.min(width, Math.round((done / total) * width)) : 0;
  return `[${"#".repeat(filled)}${".".repeat(width - filled)}]`;
}

export async function listCheckpoints(
  client: ArborClient,
  args: { model: string },
  out: Output,
): Promise<void> {
  const { id } = await resolveModel(client, args.model);
  await table(
    out,
    ["step", "model", "created", "metrics"],
    client.training.models.checkpoints.list(id, { limit: 100, order: "asc" }),
    (c) => [
      c.step,
      c.model,
      new Date(c.created_at * 1000).toISOString(),
      JSON.stringify(c.metrics),
    ],
  );
}

export async function deleteCheckpoints(
  client: ArborClient,
  args: { model: string; steps: number[] },
  out: Output,
): Promise<void> {
  const { id } = await resolveModel(client, args.model);
  const result = await client.training.models.checkpoints.delete(id, args.steps);
  out.line(
    `Deleted ${result.deleted_count}${result.not_found_steps.length ? `; not found: ${result.not_found_steps.join(", ")}` : ""}.`,
  );
}

export interface ChatArgs {
  model: string;
  messages: { role: "system" | "user" | "assistant"; content: string }[];
  maxTokens?: number | undefined;
  temperature?: number | undefined;
  topP?: number | undefined;
  seed?: number | undefined;
}

/** One chat turn, streamed to the output as it is generated. */
export async function chat(
  client: ArborClient,
  args: ChatArgs,
  write: (text: string) => void,
): Promise<string> {
  let text = "";
  for await (const chunk of await client.chat.completions.create({
    model: args.model,
    messages: args.messages,
    ...(args.maxTokens ? { max_tokens: args.maxTokens } : {}),
    ...(args.temperature !== undefined ? { temperature: args.temperature } : {}),
    ...(args.topP !== undefined ? { top_p: args.topP } : {}),
    ...(args.seed !== undefined ? { seed: args.seed } : {}),
    stream: true,
  })) {
    const piece = chunk.choices[0]?.delta.content ?? "";
    text += piece;
    write(piece);
  }
  return text;
}

/** `arbor checkpoints download`: streams the tar to FILE (through FILE.partial), checking its SHA-256. */
export async function downloadCheckpoint(
  client: ArborClient,
  args: {
    model: string;
    step: number;
    format: "peft" | "gguf" | "gguf-lora";
    outtype?: "f32" | "q8_0";
    file: string;
  },
  out: Output,
): Promise<void> {
  const { id } = await resolveModel(client, args.model);
  const content = await client.training.models.checkpoints.download(id, args.step, {
    format: args.format,
    ...(args.outtype ? { outtype: args.outtype } : {}),
  });
  const partial = `${args.file}.partial`;
  const hash = createHash("sha256");
  const source = Readable.fromWeb(
    content.body as import("node:stream/web").ReadableStream<Uint8Array>,
  );
  source.on("data", (chunk: Buffer) => hash.update(chunk));
  try {
    await pipeline(source, createWriteStream(partial));
    const digest = `sha-256=:${hash.digest("base64")}:`;
    const stated = content.digest;
    if (stated && stated !== digest) {
      throw new Error(
        `the download's SHA-256 (${digest}) is not what the server stated (${stated})`,
      );
    }
    await rename(partial, args.file);
  } catch (err) {
    await rm(partial, { force: true });
    throw err;
  }
  const { size } = await stat(args.file);
  out.line(
    `wrote ${args.file} (${size} bytes, ${args.format}${args.outtype === "q8_0" ? " Q8_0" : ""})`,
  );
}

/** `arbor checkpoints upload`: a PEFT adapter folder (tarred here) or a tar, as the next step. */
export async function uploadCheckpoint(
  client: ArborClient,
  args: { model: string; path: string },
  out: Output,
): Promise<void> {
  const model = await resolveModel(client, args.model);
  let body: Buffer;
  const found = await stat(args.path).catch(() => undefined);
  if (!found)
    throw new Error(`Cannot read the adapter ${args.path}: there is no such file or folder.`);
  if (found.isDirectory()) {
    const pack = tar.pack();
    for (const name of ["adapter_config.json", "adapter_model.safetensors"]) {
      const file = join(args.path, name);
      if (!existsSync(file))
        throw new Error(
          `The adapter folder ${args.path} has no ${name}: PEFT writes it beside the other.`,
        );
      pack.entry({ name }, readInput(file, "the adapter file"));
    }
    pack.finalize();
    const chunks: Buffer[] = [];
    for await (const chunk of pack) chunks.push(chunk as Buffer);
    body = Buffer.concat(chunks);
  } else {
    body = readInput(args.path, "the adapter tar");
  }
  const checkpoint = await client.training.models.checkpoints.upload(model.id, body);
  out.line(`step ${checkpoint.step}: ${checkpoint.model}`);
}
