import { copyFile, link, mkdir, readdir, rename, rm, stat } from "node:fs/promises";
import { basename, join, resolve } from "node:path";
import { checkModelFolder, type WeightChoice } from "@arbor/engine";

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
