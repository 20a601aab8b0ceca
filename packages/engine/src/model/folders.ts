import { open, readdir, readFile, stat } from "node:fs/promises";
import { join } from "node:path";
import { engineMemoryLimit } from "../kernels/wasm.ts";
import { catalogModelDir, listCatalog } from "./catalog.ts";
import { ChatFormat } from "./chat.ts";
import { type ModelConfig, parseConfig } from "./config.ts";
import { packedWeightBytes } from "./memory.ts";
import type { WeightChoice } from "./model.ts";
import { readChatFiles, servingRoom } from "./model.ts";
import { ModelFileError } from "./tokenizer.ts";
import { hfName, layerKeysOf, layerShape, matrixNames } from "./weights.ts";

/** A base model the engine can serve: a shipped one, or a folder under the models directory. */
export interface BaseModelFolder {
  /** `<owner>/<name>`. */
  id: string;
  dir: string;
  config: ModelConfig;
  parameters: number;
  /** llama.cpp's pre-tokenizer for its tokenizer (`ggufPreTokenizer`): undefined when none
   * splits alike, and no GGUF of it can be written. */
  ggufPre: string | undefined;
  /** Unix seconds: when the folder's config.json was written (the shipped models: their release). */
  created: number;
  /** One of the models shipped with the engine. */
  shipped: boolean;
}

/** A folder that cannot be served, and why (naming the file at fault). */
export interface SkippedFolder {
  id: string;
  dir: string;
  reason: string;
}

/** The shipped models are dated by the release that shipped them. */
const SHIPPED = Math.floor(Date.UTC(2026, 10, 23) / 1000);

/**
 * The base models: the shipped catalogue, and every `<owner>/<name>/` folder holding a
 * `config.json` under `modelsDir`, each checked without loading its weights (config, tokenizer,
 * chat template, and every tensor's name, shape and extent in the safetensors headers). A
 * folder that fails a check is skipped, with the reason. Hidden folders (a name starting with
 * `.`, such as the `.pulls/` where `arbor models pull` stages its downloads) are not looked at.
 */
export async function scanBaseModels(
  modelsDir: string | undefined,
  options: FolderCheckOptions = {},
): Promise<{ models: BaseModelFolder[]; skipped: SkippedFolder[] }> {
  const models: BaseModelFolder[] = [];
  const skipped: SkippedFolder[] = [];
  for (const entry of listCatalog()) {
    const dir = catalogModelDir(entry.id);
    const checked = await checkModelFolder(dir, options);
    models.push({ id: entry.id, dir, ...checked, created: SHIPPED, shipped: true });
  }
  if (!modelsDir) return { models, skipped };
  for (const owner of await subfolders(modelsDir)) {
    for (const name of await subfolders(join(modelsDir, owner))) {
      const id = `${owner}/${name}`;
      const dir = join(modelsDir, owner, name);
      const configPath = join(dir, "config.json");
      const written = await stat(configPath).catch(() => undefined);
      if (!written) continue;
      if (models.some((m) => m.id === id)) {
        skipped.push({ id, dir, reason: `${id} is a shipped model's id` });
        continue;
      }
      try {
        models.push({
          id,
          dir,
          ...(await checkModelFolder(dir, options)),
          created: Math.floor(written.mtimeMs / 1000),
          shipped: false,
        });
      } catch (err) {
        skipped.push({ id, dir, reason: (err as Error).message });
      }
    }
  }
  return { models, skipped };
}

export interface FolderCheckOptions {
  /** How the engine will keep the weights (ARBOR_ENGINE_WEIGHTS), which sets what fits. */
  weights?: WeightChoice;
  /**
   * false: check all but the safetensors, for a folder whose weights have not arrived yet
   * (`arbor models pull` checks this before it fetches them). The memory is then reckoned from
   * config.json's sizes, and `auto` weights by its `torch_dtype` (BF16 when it says bfloat16).
   * Default true.
   */
  tensors?: boolean;
}

/** Whether the weight matrices `loadModel` packs are all BF16 in the folder's files (false
 * when the headers cannot be read: the tensor checks then name the file). */
async function weightMatricesAreBf16(
  headers: Promise<Map<string, { dtype: string }>>,
  config: ModelConfig,
): Promise<boolean> {
  const tensors = await headers.catch(() => null);
  return tensors !== null && matrixNames(config).every((n) => tensors.get(n)?.dtype === "BF16");
}

/**
 * Checks a model folder as loading it would, without reading its weights: `config.json` (an
 * architecture the engine computes, weights that fit its memory), the tokenizer and chat
 * template, and that the safetensors hold every tensor the config needs, with its shape, within
 * the files' sizes (unless `tensors: false`). Throws a `ModelFileError` naming the file at fault.
 */
export async function checkModelFolder(
  dir: string,
  options: FolderCheckOptions = {},
): Promise<{ config: ModelConfig; parameters: number; ggufPre: string | undefined }> {
  const configPath = join(dir, "config.json");
  let config: ModelConfig;
  let raw: Record<string, unknown>;
  try {
    raw = JSON.parse(await readFile(configPath, "utf8")) as Record<string, unknown>;
    config = parseConfig(raw);
  } catch (err) {
    throw new ModelFileError(configPath, (err as Error).message.replace(/^config\.json: /, ""));
  }
  // The kernels keep every weight packed in their arena, with room to compute beside it; `auto`
  // packs in BF16 when every weight matrix of the files is BF16 (their headers say).
  const choice = options.weights ?? "f32";
  const tensorsToo = options.tensors ?? true;
  // The headers are read once, for this and the tensor checks below (which report their errors).
  let headers: ReturnType<typeof safetensorsShapes> | undefined;
  const readHeaders = () => (headers ??= safetensorsShapes(dir));
  const weights =
    choice !== "auto"
      ? choice
      : (
            tensorsToo
              ? await weightMatricesAreBf16(readHeaders(), config)
              : declaredDtype(raw) === "bfloat16"
          )
        ? "bf16"
        : "f32";
  const packed = packedWeightBytes(config, weights);
  const limit = engineMemoryLimit();
  if (packed + servingRoom(config) > limit) {
    throw new ModelFileError(
      configPath,
      `too large for the engine: its weights take ${(packed / 1e9).toFixed(2)} GB packed in ${weights.toUpperCase()}, and the engine's memory holds ${(limit / 1e9).toFixed(2)} GB`,
    );
  }
  const chat = new ChatFormat(await readChatFiles(dir), config.eosTokenId);
  if (chat.tokenizer.vocabSize > config.vocabSize) {
    throw new ModelFileError(
      join(dir, "tokenizer.json"),
      `the tokenizer has ${chat.tokenizer.vocabSize} tokens, more than the model's vocab_size ${config.vocabSize}`,
    );
  }
  const need = new Map<string, number[]>([
    ["model.embed_tokens.weight", [config.vocabSize, config.hiddenSize]],
    ["model.norm.weight", [config.hiddenSize]],
  ]);
  if (!config.tieWordEmbeddings) need.set("lm_head.weight", [config.vocabSize, config.hiddenSize]);
  for (let l = 0; l < config.numLayers; l++) {
    for (const key of layerKeysOf(config)) need.set(hfName(l, key), layerShape(config, key));
  }
  let parameters = 0;
  for (const shape of need.values()) parameters += shape.reduce((a, b) => a * b, 1);
  const ggufPre = chat.tokenizer.ggufPreTokenizer();
  if (!tensorsToo) return { config, parameters, ggufPre };
  const tensors = await readHeaders();
  for (const [name, shape] of need) {
    const found = tensors.get(name);
    if (!found) throw new ModelFileError(join(dir, "model.safetensors"), `missing tensor ${name}`);
    if (found.shape.join(",") !== shape.join(",")) {
      throw new ModelFileError(
        found.file,
        `${name} has shape [${found.shape}], config.json says [${shape}]`,
      );
    }
  }
  return { config, parameters, ggufPre };
}

/** The dtype config.json says the weights are in: `torch_dtype`, or transformers 5's `dtype`. */
function declaredDtype(raw: Record<string, unknown>): unknown {
  return raw.torch_dtype ?? raw.dtype;
}

/** Every tensor's shape and file, from the safetensors headers (shards included). */
async function safetensorsShapes(
  dir: string,
): Promise<Map<string, { shape: number[]; file: string; dtype: string }>> {
  let files = ["model.safetensors"];
  const indexPath = join(dir, "model.safetensors.index.json");
  const index = await readFile(indexPath, "utf8").catch(() => undefined);
  if (index !== undefined) {
    try {
      const map = (JSON.parse(index) as { weight_map?: Record<string, string> }).weight_map ?? {};
      files = [...new Set(Object.values(map))];
    } catch (err) {
      throw new ModelFileError(indexPath, `not valid JSON (${(err as Error).message})`);
    }
  }
  const out = new Map<string, { shape: number[]; file: string; dtype: string }>();
  for (const name of files) {
    const path = join(dir, name);
    const handle = await open(path, "r").catch(() => {
      throw new ModelFileError(path, "missing (the model's weights)");
    });
    try {
      const { size } = await handle.stat();
      const head = Buffer.alloc(8);
      await handle.read(head, 0, 8, 0);
      const length = size >= 8 ? Number(head.readBigUInt64LE(0)) : -1;
      if (length < 0 || length > size - 8 || length > 100 * 1024 * 1024) {
        throw new ModelFileError(path, "truncated or not safetensors");
      }
      const header = Buffer.alloc(length);
      await handle.read(header, 0, length, 8);
      const entries = JSON.parse(header.toString("utf8")) as Record<
        string,
        { dtype?: string; shape?: number[]; data_offsets?: [number, number] }
      >;
      for (const [tensor, entry] of Object.entries(entries)) {
        if (tensor === "__metadata__") continue;
        if (!["F32", "F16", "BF16"].includes(entry.dtype ?? "")) {
          throw new ModelFileError(
            path,
            `${tensor} is ${entry.dtype}: only F32, F16 and BF16 are read`,
          );
        }
        if ((entry.data_offsets?.[1] ?? 0) + 8 + length > size) {
          throw new ModelFileError(path, `truncated: ${tensor} ends past the end of the file`);
        }
        out.set(tensor, { shape: entry.shape ?? [], file: path, dtype: entry.dtype ?? "" });
      }
    } catch (err) {
      if (err instanceof ModelFileError) throw err;
      throw new ModelFileError(path, (err as Error).message);
    } finally {
      await handle.close();
    }
  }
  return out;
}

async function subfolders(dir: string): Promise<string[]> {
  const entries = await readdir(dir, { withFileTypes: true }).catch(() => []);
  return entries
    .filter((e) => (e.isDirectory() || e.isSymbolicLink()) && !e.name.startsWith("."))
    .map((e) => e.name)
    .sort();
}
