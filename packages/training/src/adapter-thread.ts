/** The adapter check's thread: reads each upload's PEFT files, checks them against the base and
 * writes them again as this base's F32 files (see AdapterChecker in adapters.ts). */
import { parentPort } from "node:worker_threads";
import {
  AdapterError,
  adapterFromFiles,
  adapterToFiles,
  type ModelConfig,
} from "@arbor/engine/model";

parentPort!.on(
  "message",
  (input: { files: Record<string, Uint8Array[]>; config: ModelConfig; baseId: string }) => {
    try {
      // Each file comes as the blocks it arrived in: joined here, off the server's thread.
      const uploaded = Object.fromEntries(
        Object.entries(input.files).map(([name, blocks]) => [
          name,
          blocks.length === 1 ? blocks[0]! : Buffer.concat(blocks),
        ]),
      );
      input.files = {};
      const adapter = adapterFromFiles(uploaded, { config: input.config });
      // The uploaded bytes are done with: the stored files are written without them.
      for (const name of Object.keys(uploaded)) delete uploaded[name];
      const files = adapterToFiles({ ...adapter, baseModel: input.baseId });
      parentPort!.postMessage(
        { named: adapter.baseModel, files },
        Object.values(files).map((bytes) => bytes.buffer as ArrayBuffer),
      );
    } catch (err) {
      parentPort!.postMessage(
        err instanceof AdapterError
          ? { refused: { message: err.message, param: err.param } }
          : { failed: err instanceof Error ? err.message : String(err) },
      );
    }
  },
);
