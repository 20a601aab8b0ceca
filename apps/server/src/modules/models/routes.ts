import type { Readable } from "node:stream";
import { pipeline } from "node:stream/promises";
import type { ModelConfig } from "@arbor/engine/model";
import { InvalidInputError, NotFoundError, type Store } from "@arbor/store";
import {
  adapterTrainsHead,
  checkpointAdapterTar,
  checkpointGguf,
  importAdapter,
  readAdapterTar,
  reprDigest,
} from "@arbor/training";
import { type Handlers, RESPONDED } from "../../http/operations.ts";
import { unzippingUpload, uploadBody } from "../../http/uploads.ts";
import {
  type CheckpointsDeleted,
  checkpointToWire,
  createModel,
  deleteCheckpoints,
  deleteModel,
  findModel,
  logMetrics,
  modelToWire,
} from "./service.ts";

/** `createCheckpoint`'s multipart parts, by the files they carry. */
const MULTIPART_FILES: Record<string, string> = {
  adapter_config: "adapter_config.json",
  adapter_model: "adapter_model.safetensors",
};

export interface ModelsDeps {
  store: Store;
  baseModels: () => Promise<string[]>;
  /** A base model the engine serves: its folder, and its config (the shapes an adapter must fit). */
  baseModel: (
    id: string,
  ) => Promise<{ dir: string; config: ModelConfig; ggufPre: string | undefined } | undefined>;
  /** Told of checkpoints deleted (their rows and files gone), by their files' keys: upstreams
   * serving them unload them. Never throws. */
  checkpointsDeleted?: CheckpointsDeleted;
}

/** Models and their checkpoints (the spec's `models` operations). */
export function modelsHandlers(deps: ModelsDeps): Handlers {
  const { store } = deps;
  return {
    createModel: ({ body, principal }) => createModel(deps, principal, body),
    deleteModel: ({ params, principal }) =>
      deleteModel(store, principal, params.model_id, deps.checkpointsDeleted),

    listTrainableModels: async ({ query, principal }) => {
      const page = await store.models.list(principal.entities, {
        after: query.after,
        limit: query.limit ?? 20,
        project: query.project,
        order: "desc",
      });
      return { object: "list", ...page, data: page.data.map(modelToWire) };
    },

    listCheckpoints: async ({ params, query, principal }) => {
      const model = await findModel(store, principal, params.model_id);
      const page = await store.models.listCheckpoints(model.entity, model.id, {
        after: query.after,
        limit: query.limit ?? 20,
        order: query.order ?? "asc",
      });
      return {
        object: "list",
        data: page.data.map((c) => checkpointToWire(model, c)),
        first_id: page.first_id,
        last_id: page.last_id,
        has_more: page.has_more,
      };
    },

    createCheckpoint: async ({ params, req, res, principal }) => {
      const model = await findModel(store, principal, params.model_id);
      const baseConfig = (await deps.baseModel(model.base_model))?.config;
      if (!baseConfig) {
        throw new InvalidInputError(
          `The model's base ${model.base_model} is not served by the engine here, so it cannot take an adapter.`,
          { code: "unsupported_base_model" },
        );
      }
      // Aborted when the client goes before its answer: the check stops and nothing is stored.
      const gone = new AbortController();
      res.on("close", () => {
        if (!res.writableFinished) gone.abort(new Error("the client went away"));
      });
      // Multipart parts (the validator's multer leaves them in req.files, in blocks), or a tar,
      // read as it arrives.
      const parts = (req as { files?: { fieldname: string; parts: Uint8Array[] }[] }).files;
      let files: Record<string, Uint8Array | Uint8Array[]>;
      if (Array.isArray(parts)) {
        files = Object.fromEntries(
          parts.map((p) => [MULTIPART_FILES[p.fieldname] ?? p.fieldname, p.parts]),
        );
      } else {
        const body = uploadBody(req);
        try {
          files = await readAdapterTar(body.chunks, { onGzip: () => unzippingUpload(res) });
        } finally {
          // What a refusal left unread is read and dropped, so that the answer goes out.
          body.drain();
        }
      }
      return checkpointToWire(
        model,
        await importAdapter(store, { model, baseConfig, files, signal: gone.signal }),
      );
    },

    getCheckpointContent: async ({ params, query, res, principal }): Promise<typeof RESPONDED> => {
      const model = await findModel(store, principal, params.model_id);
      const checkpoint = await store.models.getCheckpoint(model.entity, model.id, params.step);
      const blobs = store.blobs;
      if (!checkpoint) {
        throw new NotFoundError(`Model ${model.id} has no checkpoint at step ${params.step}.`, {
          code: "checkpoint_not_found",
        });
      }
      const label = `${model.name}-step${checkpoint.step}`;
      let body: { bytes: number; digest: string; open: () => Readable | Promise<Readable> };
      let file: string;
      let type: string;
      const format = query.format ?? "peft";
      const outtype = query.outtype ?? "f32";
      if (outtype !== "f32" && format !== "gguf") {
        throw new InvalidInputError(
          `outtype=${outtype} applies to format=gguf (the merged model) only; format=${format} has no weight matrices to quantize. Download format=gguf&outtype=${outtype}, or leave outtype out.`,
          { param: "outtype", code: "unsupported_outtype" },
        );
      }
      if (format === "gguf" || format === "gguf-lora") {
        const base = await deps.baseModel(model.base_model);
        if (!base || !checkpoint.blob_key) {
          throw new InvalidInputError(
            `The model's base ${model.base_model} is not served by the engine here, so it cannot be exported as GGUF.`,
            { param: "format", code: "unsupported_base_model" },
          );
        }
        if (
          format === "gguf-lora" &&
          base.config.tieWordEmbeddings &&
          (await adapterTrainsHead(blobs, checkpoint.blob_key))
        ) {
          throw new InvalidInputError(
            `Step ${checkpoint.step} trains the output head, which ${model.base_model} ties to its embedding: a llama.cpp LoRA GGUF cannot carry that (the base's GGUF has no output tensor to adapt). Download format=gguf (the merged model) or peft instead.`,
            { param: "format", code: "unsupported_adapter" },
          );
        }
        if (format === "gguf" && base.ggufPre === undefined) {
          throw new InvalidInputError(
            `The tokenizer of ${model.base_model} splits text in a way llama.cpp has no pre-tokenizer for, so a GGUF of it would tokenize differently; download format=peft or gguf-lora instead.`,
            { param: "format", code: "unsupported_tokenizer" },
          );
        }
        const gguf = await checkpointGguf(
          blobs,
          { ...checkpoint, blob_key: checkpoint.blob_key },
          format,
          base.dir,
          label,
          outtype,
        );
        body = {
          ...gguf,
          open: async () => {
            const stream = await blobs.stream(gguf.key);
            if (!stream) throw new Error(`the export ${gguf.key} is gone`);
            return stream;
          },
        };
        file =
          format === "gguf-lora"
            ? `${label}-lora.gguf`
            : outtype === "q8_0"
              ? `${label}-Q8_0.gguf`
              : `${label}.gguf`;
        type = "application/octet-stream";
      } else {
        const archive = await checkpointAdapterTar(blobs, checkpoint, label);
        body = { ...archive, digest: await reprDigest(archive.open()) };
        file = `${label}-peft.tar`;
        type = "application/x-tar";
      }
      res.status(200);
      res.setHeader("Content-Type", type);
      res.setHeader("Content-Length", String(body.bytes));
      res.setHeader("Content-Disposition", `attachment; filename="${file}"`);
      res.setHeader("Repr-Digest", body.digest);
      await pipeline(await body.open(), res);
      return RESPONDED;
    },

    deleteCheckpoints: ({ params, body, principal }) =>
      deleteCheckpoints(store, principal, params.model_id, body.steps, deps.checkpointsDeleted),

    logModelMetrics: ({ params, body, principal }) =>
      logMetrics(store, principal, params.model_id, body),
  };
}
