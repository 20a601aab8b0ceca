/** A GGUF export's thread: reads the base and the adapter, writes the file (see exports.ts). */
import { readFile } from "node:fs/promises";
import { join } from "node:path";
import { workerData } from "node:worker_threads";
import {
  adapterFromFiles,
  exportGguf,
  exportLoraGguf,
  type GgufOuttype,
  loadModel,
  mergeAdapter,
  parseConfig,
} from "@arbor/engine/model";

const { kind, outtype, baseDir, files, path, name } = workerData as {
  kind: "gguf" | "gguf-lora";
  outtype: GgufOuttype;
  baseDir: string;
  files: Record<string, Uint8Array>;
  path: string;
  name: string;
};
if (kind === "gguf") {
  const base = await loadModel(baseDir);
  await exportGguf(mergeAdapter(base, adapterFromFiles(files, base)), path, name, outtype);
} else {
  // The adapter alone needs only the base's shapes, not its weights.
  const config = parseConfig(JSON.parse(await readFile(join(baseDir, "config.json"), "utf8")));
  await exportLoraGguf(config, adapterFromFiles(files, { config }), path, name);
}
