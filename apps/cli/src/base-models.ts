import { copyFile, link, mkdir, readdir, rename, rm, stat } from "node:fs/promises";
import { basename, join, resolve } from "node:path";
import {
  checkModelFolder,
  parseRepoArgument,
  pullModel,
  type WeightChoice,
} from "@arbor/engine/model";

/** `owner/name`: two names of the spec's grammar. */
const ID = /^(?!\.\.?\/)[A-Za-z0-9._-]{1,128}\/(?!\.\.?$)[A-Za-z0-9._-]{1,128}$/;

/**
 * Puts a Hugging Face model folder under the base-models directory as `<owner>/<name>`, after
 * checking it as the server would (config, tokenizer, template, tensors): its files are
 * hard-linked when they can be (same file system), else copied, into a temporary folder that is
 * then renamed into place. Sub-folders (such as Llama's `original/`) are left out.
 */
export async function addBaseModel(
  args: {
    folder: string;
    id?: string | undefined;
    modelsDir: string;
    /** How the server's engines keep weights (ARBOR_ENGINE_WEIGHTS): what fits depends on it. */
    weights?: WeightChoice;
  },
  out: { line(text: string): void },
): Promise<string> {
  const source = resolve(args.folder);
  const id = args.id ?? `local/${basename(source)}`;
  if (!ID.test(id)) throw new Error(`--id must be "<owner>/<name>", got ${JSON.stringify(id)}.`);
  const { config, parameters } = await checkModelFolder(source, {
    weights: args.weights ?? "auto",
  });
  const target = join(args.modelsDir, ...id.split("/"));
  if (await stat(target).catch(() => undefined)) {
    throw new Error(`${target} already exists: remove it first, or choose another --id.`);
  }
  const temp = `${target}.tmp-${process.pid}`;
  await mkdir(temp, { recursive: true });
  try {
    for (const entry of await readdir(source, { withFileTypes: true })) {
      if (!entry.isFile()) continue;
      const from = join(source, entry.name);
      const to = join(temp, entry.name);
      await link(from, to).catch(() => copyFile(from, to));
    }
    await rename(temp, target);
  } catch (err) {
    await rm(temp, { recursive: true, force: true });
    throw err;
  }
  out.line(
    `Added ${id} (${config.modelType}, ${(parameters / 1e6).toFixed(1)}M parameters) at ${target}.`,
  );
  return id;
}

/** Where progress goes: stderr, redrawn in place on a terminal, else a line now and then. */
export interface ProgressOut {
  tty: boolean;
  write(text: string): void;
}

/**
 * `arbor models pull`: pulls a model from the Hugging Face Hub (HF_ENDPOINT, HF_TOKEN) into the
 * base-models directory under its repo id or `--id` (see pullModel), saying what it resolved and
 * what the engine made of it on stdout, and its progress on `progress`.
 */
export async function pullBaseModel(
  args: {
    /** `owner/name[@revision]`. */
    repo: string;
    id?: string | undefined;
    modelsDir: string;
    endpoint: string;
    token?: string | undefined;
    weights?: WeightChoice;
    /** Injected for tests: the wait before a retry. */
    retryDelay?: (attempt: number) => number;
  },
  out: { line(text: string): void; progress?: ProgressOut | undefined },
): Promise<string> {
  const { repo, revision } = parseRepoArgument(args.repo);
  const bar = progressLine(out.progress);
  let result: Awaited<ReturnType<typeof pullModel>>;
  try {
    result = await pullModel({
      repo,
      revision,
      id: args.id,
      modelsDir: args.modelsDir,
      endpoint: args.endpoint,
      token: args.token,
      weights: args.weights ?? "auto",
      ...(args.retryDelay ? { retryDelay: args.retryDelay } : {}),
      onEvent: (event) => {
        if (event.type === "resolved") {
          out.line(`${repo}@${event.revision} is commit ${event.commit} on ${args.endpoint}.`);
        } else if (event.type === "checked") {
          bar.end();
          out.line(
            `The engine can serve it (${event.config.modelType}, ${millions(event.parameters)} parameters): fetching ${event.files.length === 1 ? event.files[0] : `${event.files.length} shards`} (${sizeText(event.bytes)}).`,
          );
        } else if (event.type === "progress") {
          bar.update(event.path, event.allDone, event.allSize);
        } else if (event.type === "retry") {
          bar.note(`${event.path}: ${event.reason}; resuming (attempt ${event.attempt + 1})`);
        }
      },
    });
  } finally {
    bar.end();
  }
  const { manifest } = result;
  out.line(
    result.existing
      ? `${result.id} is already here, pulled from ${manifest.repo_id} at ${manifest.commit} (${result.dir}).`
      : `Pulled ${manifest.repo_id} at ${manifest.commit} as ${result.id} (${result.config.modelType}, ${millions(result.parameters)} parameters, ${manifest.files.length} files verified, ${sizeText(result.fetched)} fetched) into ${result.dir}.`,
  );
  return result.id;
}

function millions(n: number): string {
  return `${(n / 1e6).toFixed(1)}M`;
}

function sizeText(n: number): string {
  return n < 1e6
    ? `${(n / 1e3).toFixed(1)} kB`
    : n < 1e9
      ? `${(n / 1e6).toFixed(1)} MB`
      : `${(n / 1e9).toFixed(2)} GB`;
}

/** A progress bar over the whole pull: redrawn at most ten times a second on a terminal; else
 * a line at each tenth of the bytes. */
function progressLine(out: ProgressOut | undefined) {
  let drawn = 0;
  let tenth = -1;
  let open = false;
  const text = (path: string, done: number, total: number) =>
    `${bar(done, total)} ${total > 0 ? Math.floor((done / total) * 100) : 0}% ${sizeText(done)} of ${sizeText(total)}  ${path}`;
  return {
    update(path: string, done: number, total: number) {
      if (!out) return;
      if (out.tty) {
        const now = Date.now();
        if (now - drawn < 100 && done < total) return;
        drawn = now;
        out.write(`\r${text(path, done, total)}\x1b[K`);
        open = true;
      } else {
        const at = total > 0 ? Math.floor((done / total) * 10) : 0;
        if (at === tenth) return;
        tenth = at;
        out.write(`${text(path, done, total)}\n`);
      }
    },
    note(line: string) {
      if (!out) return;
      out.write(out.tty ? `\r${line}\x1b[K\n` : `${line}\n`);
      open = false;
    },
    end() {
      if (out?.tty && open) out.write("\n");
      open = false;
      tenth = -1;
    },
  };
}

function bar(done: number, total: number, width = 24): string {
  const filled = total > 0 ? Math.min(width, Math.round((done / total) * width)) : 0;
  return `[${"#".repeat(filled)}${".".repeat(width - filled)}]`;
}
