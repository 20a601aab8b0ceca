import { createHash } from "node:crypto";
import { Readable, Transform, Writable } from "node:stream";
import { pipeline } from "node:stream/promises";
import { gunzipSync } from "node:zlib";
import { AdapterError, adapterFromFiles, adapterToFiles, type ModelConfig } from "@arbor/engine";
import {
  type BlobStore,
  type Checkpoint,
  ConflictError,
  DomainError,
  InvalidInputError,
  type Model,
  NotFoundError,
  quote,
  type Store,
} from "@arbor/store";
import tar from "tar-stream";
import {
  ADAPTER_FILES,
  type CheckpointFiles,
  withModelFiles,
  writeCheckpointFiles,
} from "./checkpoints.ts";

/** The largest adapter upload, compressed or not (a rank-64 adapter of a 1B model is ~180 MB). */
export const ADAPTER_MAX_BYTES = 256 * 1024 * 1024;

const invalid = (message: string, param: string | null = null) =>
  new InvalidInputError(message, { code: "invalid_adapter", param });

/**
 * The two PEFT files out of an uploaded tar (gzipped or not), at its top or in one folder; other
 * regular files are ignored. A path that climbs out (`..`, `/…`), a duplicate, a cut-off or
 * non-tar body is an InvalidInputError.
 */
export async function readAdapterTar(body: Uint8Array): Promise<CheckpointFiles> {
  let bytes = body;
  if (bytes[0] === 0x1f && bytes[1] === 0x8b) {
    try {
      bytes = gunzipSync(bytes, { maxOutputLength: ADAPTER_MAX_BYTES });
    } catch (err) {
      throw invalid(
        (err as { code?: string }).code === "ERR_BUFFER_TOO_LARGE"
          ? `The tar is over ${ADAPTER_MAX_BYTES} bytes unzipped.`
          : `The body is not a valid gzip stream: ${(err as Error).message}.`,
      );
    }
  }
  if (bytes.length === 0) throw invalid("The body is empty: send a tar of the PEFT adapter files.");
  const files: CheckpointFiles = {};
  const extract = tar.extract();
  let refused: InvalidInputError | undefined;
  extract.on("entry", (header, stream, next) => {
    // A cut-off entry errors on the archive too, where it is handled.
    stream.on("error", () => {});
    const refuse = (err: InvalidInputError) => {
      refused = err;
      stream.resume();
      extract.destroy();
    };
    const name = header.name.replace(/^(\.\/)+/, "");
    const parts = name.split("/").filter((p) => p !== "");
    if (name.startsWith("/") || name.includes("\\") || parts.includes("..")) {
      return refuse(invalid(`The tar entry ${quote(header.name)} leaves the archive's folder.`));
    }
    const base = parts.at(-1) ?? "";
    const wanted =
      header.type === "file" && parts.length <= 2 && ADAPTER_FILES.some((f) => f === base);
    if (!wanted) {
      stream.on("end", next);
      stream.resume();
      return;
    }
    if (files[base]) return refuse(invalid(`The tar holds ${base} twice.`, base));
    const chunks: Buffer[] = [];
    stream.on("data", (c: unknown) => chunks.push(c as Buffer));
    stream.on("end", () => {
      files[base] = Buffer.concat(chunks);
      next();
    });
  });
  try {
    // streamx closes after the last entry, or once destroyed by a refusal.
    await new Promise<void>((resolve, reject) => {
      extract.on("close", resolve);
      extract.on("error", reject);
      extract.end(bytes);
    });
  } catch (err) {
    throw invalid(`The body is not a complete tar: ${(err as Error).message}.`);
  }
  if (refused) throw refused;
  for (const name of ADAPTER_FILES) {
    if (!files[name])
      throw invalid(`The tar has no ${name} (PEFT's save_pretrained writes it).`, name);
  }
  return files;
}

/** A checkpoint's PEFT files as a tar: its exact length and a stream of it, made as read. */
export interface AdapterTar {
  bytes: number;
  open(): Readable;
}

/** 512-byte header, then the data padded to 512; two zero blocks end the archive. */
const tarBytes = (sizes: number[]) =>
  sizes.reduce((n, size) => n + 512 + Math.ceil(size / 512) * 512, 0) + 1024;

/** The adapter files of `checkpoint` as a tar, streamed from the blob store, never built whole. */
export async function checkpointAdapterTar(
  blobs: BlobStore,
  checkpoint: Checkpoint,
  label: string,
): Promise<AdapterTar> {
  const prefix = checkpoint.blob_key;
  const notFound = () =>
    new NotFoundError(
      `Step ${checkpoint.step} has no weights: ${checkpoint.step === 0 ? "step 0 is the base model itself" : "its files are gone"}.`,
      { code: "checkpoint_not_found" },
    );
  if (!prefix) throw notFound();
  const entries: { name: string; size: number }[] = [];
  for (const name of ADAPTER_FILES) {
    const info = await blobs.info(`${prefix}${name}`);
    if (!info) throw notFound();
    entries.push({ name, size: info.bytes });
  }
  const mtime = new Date(checkpoint.created_at * 1000);
  return {
    bytes: tarBytes(entries.map((e) => e.size)),
    open() {
      const pack = tar.pack();
      // The reader may go away at any point (a client that cuts the download off): then the
      // pack is destroyed, and what is being written into it stops quietly. Every stream here
      // has an error listener, so nothing reaches the process as an unhandled error.
      const gone = () => pack.destroyed || (pack as { destroying?: boolean }).destroying === true;
      (async () => {
        for (const { name, size } of entries) {
          if (gone()) return;
          const source = await blobs.stream(`${prefix}${name}`);
          if (!source) throw notFound();
          await new Promise<void>((resolve, reject) => {
            const fail = (err: Error) => {
              source.destroy();
              reject(err);
            };
            const header = { name: `${label}/${name}`, size, mtime, mode: 0o644 };
            const entry = pack.entry(header, (err) => (err ? fail(err) : resolve()));
            entry.on("error", fail);
            source.on("error", fail);
            source.pipe(entry as unknown as NodeJS.WritableStream);
          });
        }
        pack.finalize();
      })().catch((err: unknown) => {
        if (!gone()) pack.destroy(err as Error);
      });
      return Readable.from(pack);
    },
  };
}

/** A pass-through that hashes what flows through it; `digest()` (once it has ended) is its
 * SHA-256 as RFC 9530's `sha-256=:<base64>:`. */
export function digestTap(): { tap: Transform; digest(): string } {
  const hash = createHash("sha256");
  const tap = new Transform({
    transform(chunk: Buffer, _encoding, done) {
      hash.update(chunk);
      done(null, chunk);
    },
  });
  return { tap, digest: () => `sha-256=:${hash.digest("base64")}:` };
}

/** SHA-256 of a whole stream, as RFC 9530's `sha-256=:<base64>:`. */
export async function reprDigest(stream: Readable): Promise<string> {
  const { tap, digest } = digestTap();
  await pipeline(stream, tap, new Writable({ write: (_chunk, _encoding, done) => done() }));
  return digest();
}

export interface ImportAdapterInput {
  model: Model;
  /** The base's config: the shapes the adapter must fit. */
  baseConfig: ModelConfig;
  files: CheckpointFiles;
}

/**
 * Adds a PEFT adapter trained elsewhere as the model's next checkpoint: checked against the
 * base (AdapterError → InvalidInputError naming the field or tensor), stored as F32 under PEFT's
 * names with this base's id, files first, then the row; nothing stays behind on any failure.
 * A delete of the model waits for it (withModelFiles); one that came first makes it a 404.
 */
export function importAdapter(store: Store, input: ImportAdapterInput): Promise<Checkpoint> {
  return withModelFiles(input.model.id, "write", () => addAdapter(store, input));
}

async function addAdapter(store: Store, input: ImportAdapterInput): Promise<Checkpoint> {
  const { model, baseConfig, files } = input;
  for (const status of ["running", "queued"] as const) {
    const active = await store.jobs.list(model.entity, { model_id: model.id, status, limit: 1 });
    const job = active.data[0];
    if (job) {
      throw new ConflictError(
        `Training job ${job.id} of this model is ${status}; upload when it has ended.`,
        { code: "job_in_progress" },
      );
    }
  }
  let adapter: ReturnType<typeof adapterFromFiles>;
  try {
    adapter = adapterFromFiles(files, { config: baseConfig });
  } catch (err) {
    if (err instanceof AdapterError) throw invalid(err.message, err.param);
    throw err;
  }
  const named = adapter.baseModel;
  if (named !== "" && !sameBase(named, model.base_model)) {
    throw invalid(
      `adapter_config.json: base_model_name_or_path is ${quote(named)}, but this model's base is ${quote(model.base_model)}.`,
      "base_model_name_or_path",
    );
  }
  const blobs = store.blobs;
  if (!blobs) throw new Error("the store has no blob directory");
  const step = (model.latest_step ?? 0) + 1;
  let prefix: string | undefined;
  try {
    prefix = await writeCheckpointFiles(
      blobs,
      model.id,
      step,
      adapterToFiles({ ...adapter, baseModel: model.base_model }),
    );
    return await store.models.addCheckpoint(model.entity, model.id, { step, blob_key: prefix });
  } catch (err) {
    if (prefix) await blobs.deletePrefix(prefix);
    // A write cut off by another process deleting the model (its folder removed mid-write):
    // the upload answers as the model now is, not found.
    if (!(err instanceof DomainError) && !(await store.models.get(model.entity, model.id)))
      throw new NotFoundError(`Model ${quote(model.id)} not found.`, { code: "model_not_found" });
    throw err;
  }
}

/** The base's id, or a hub id or path naming the same model (`…/Qwen3-0.6B`). */
function sameBase(named: string, baseId: string): boolean {
  const last = (s: string) =>
    s
      .replace(/[\\/]+$/, "")
      .split(/[\\/]/)
      .at(-1)!
      .toLowerCase();
  return named === baseId || last(named) === last(baseId);
}
