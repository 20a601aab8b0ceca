/** A merged GGUF export's thread: loads the base and the adapter, folds it in, writes the file. */
import { workerData } from "node:worker_threads";
import { adapterFromFiles, exportGguf, loadModel, mergeAdapter } from "@arbor/engine";

const { baseDir, files, path, name } = workerData as {
  baseDir: string;
  files: Record<string, Uint8Array>;
  path: string;
  name: string;
};
const base = await loadModel(baseDir);
await exportGguf(mergeAdapter(base, adapterFromFiles(files, base)), path, name);
