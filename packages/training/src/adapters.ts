import { createHash } from "node:crypto";
import { Readable, Transform, Writable } from "node:stream";
import { pipeline } from "node:stream/promises";
import { Worker } from "node:worker_threads";
import { createGunzip } from "node:zlib";
import type { ModelConfig } from "@arbor/engine/model";
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
  activeJobOf,
  type CheckpointFiles,
  ownBuffer,
  withModelFiles,
  writeCheckpointFiles,
} from "./checkpoints.ts";

/** The largest adapter upload, compressed or not (a rank-64 adapter of a 1B model is ~180 MB). */
export const ADAPTER_MAX_BYTES = 256 * 1024 * 1024;

/** The largest `adapter_config.json`: PEFT writes about a kilobyte. */
const CONFIG_MAX_BYTES = 1024 * 1024;

const invalid = (message: string, param: string | null = null) =>
  new InvalidInputError(message, { code: "invalid_adapter", param });

/**
 * The two PEFT files out of an uploaded tar (gzipped or not), at its top or in one folder; other
 * regular files are ignored. The tar is read as it arrives, never held whole: a body over
 * ADAPTER_MAX_BYTES is a DomainError too_large; gzip is undone by zlib off the event loop and
 * stops at ADAPTER_MAX_BYTES unzipped. A path that climbs out (`..`, `/…`), a duplicate, an
 * entry larger than the cap, a cut-off or non-tar body is an InvalidInputError.
 */
export async function readAdapterTar(
  body: Uint8Array | AsyncIterable<Uint8Array>,
  options: {
    /** Told when the body turns out to be gzipped, before any of it is unzipped; may throw
     * (a DomainError) to refuse it. */
    onGzip?: () => void;
  } = {},
): Promise<CheckpointFiles> {
  const files: CheckpointFiles = {};
  const extract = tar.extract();
  let refused: DomainError | undefined;
  const refuse = (err: DomainError) => {
    refused ??= err;
    extract.destroy();
  };
  extract.on("entry", (header, stream, next) => {
    // A cut-off entry errors on the archive too, where it is handled.
    stream.on("error", () => {});
    const refuseEntry = (err: DomainError) => {
      stream.resume();
      refuse(err);
    };
    const name = header.name.replace(/^(\.\/)+/, "");
    const parts = name.split("/").filter((p) => p !== "");
    if (name.startsWith("/") || name.includes("\\") || parts.includes("..")) {
      return refuseEntry(
        invalid(`The tar entry ${quote(header.name)} leaves the archive's folder.`),
      );
    }
    const base = parts.at(-1) ?? "";
    const wanted =
      header.type === "file" && parts.length <= 2 && ADAPTER_FILES.some((f) => f === base);
    if (!wanted) {
      stream.on("end", next);
      stream.resume();
      return;
    }
    if (files[base]) return refuseEntry(invalid(`The tar holds ${base} twice.`, base));
    const cap = base === "adapter_config.json" ? CONFIG_MAX_BYTES : ADAPTER_MAX_BYTES;
    if ((header.size ?? 0) > cap) {
      return refuseEntry(invalid(`The tar's ${base} is ${header.size} bytes, over ${cap}.`, base));
    }
    // Filled as the entry's data arrives, into one buffer of the size its header gives (whose
    // pages the system commits only as they are written): no copy of the whole file at its end,
    // which for hundreds of megabytes would hold up the event loop.
    const size = header.size ?? 0;
    let file: Buffer | undefined;
    let at = 0;
    stream.on("data", (c: unknown) => {
      file ??= Buffer.allocUnsafe(size);
      at += (c as Buffer).copy(file, at);
    });
    stream.on("end", () => {
      files[base] = file ? file.subarray(0, at) : Buffer.alloc(0);
      next();
    });
  });
  // streamx closes after the last entry, or once destroyed by a refusal or a fault.
  const closed = new Promise<void>((resolve, reject) => {
    extract.on("close", resolve);
    extract.on("error", reject);
  });
  closed.catch(() => {});
  let received = 0;
  try {
    const chunks = unzipped(
      body,
      (bytes) => {
        received += bytes;
        if (received > ADAPTER_MAX_BYTES) {
          throw new DomainError("too_large", `The body is over ${ADAPTER_MAX_BYTES} bytes.`, {
            code: "request_too_large",
          });
        }
      },
      options.onGzip,
    );
    for await (const chunk of chunks) {
      if (extract.destroyed) break;
      // Written as the tar is read: a slow reader holds back the body, not memory.
      if (!extract.write(chunk)) {
        await new Promise<void>((resolve) => {
          const go = () => {
            extract.off("drain", go);
            extract.off("close", go);
            resolve();
          };
          extract.on("drain", go);
          extract.on("close", go);
        });
      }
    }
    if (received === 0) throw invalid("The body is empty: send a tar of the PEFT adapter files.");
    // The types ask for a chunk; streamx ends without one.
    (extract as unknown as NodeJS.WritableStream).end();
    await closed;
  } catch (err) {
    extract.destroy();
    if (refused) throw refused;
    if (err instanceof DomainError) throw err;
    if (err instanceof UnzippedTooLarge) {
      throw invalid(`The tar is over ${ADAPTER_MAX_BYTES} bytes unzipped.`);
    }
    if ((err as { code?: string }).code?.startsWith("Z_")) {
      throw invalid(`The body is not a valid gzip stream: ${(err as Error).message}.`);
    }
    throw invalid(`The body is not a complete tar: ${(err as Error).message}.`);
  }
  if (refused) throw refused;
  for (const name of ADAPTER_FILES) {
    if (!files[name])
      throw invalid(`The tar has no ${name} (PEFT's save_pretrained writes it).`, name);
  }
  return files;
}

class UnzippedTooLarge extends Error {}

/**
 * The bytes of `body` (each counted by `received` as it arrives), gunzipped when they begin as
 * gzip does: by zlib's asynchronous stream, on libuv's threads, and no further than
 * ADAPTER_MAX_BYTES of output (a gzip bomb stops there).
 */
async function* unzipped(
  body: Uint8Array | AsyncIterable<Uint8Array>,
  received: (bytes: number) => void,
  onGzip: (() => void) | undefined,
): AsyncGenerator<Uint8Array> {
  const source = (async function* () {
    if (body instanceof Uint8Array) {
      received(body.byteLength);
      yield body;
      return;
    }
    for await (const chunk of body) {
      received(chunk.byteLength);
      yield chunk;
    }
  })();
  // The first two bytes say whether it is gzip.
  const head: Uint8Array[] = [];
  let headBytes = 0;
  while (headBytes < 2) {
    const next = await source.next();
    if (next.done) break;
    head.push(next.value);
    headBytes += next.value.byteLength;
  }
  const first = Buffer.concat(head);
  const all = (async function* () {
    if (first.byteLength > 0) yield first;
    yield* source;
  })();
  if (!(first[0] === 0x1f && first[1] === 0x8b)) {
    yield* all;
    return;
  }
  onGzip?.();
  // Larger chunks than zlib's 16 KiB: a quarter of the work per byte in the tar reader.
  const gunzip = createGunzip({ chunkSize: 64 * 1024 });
  const input = Readable.from(all, { objectMode: false });
  // Errors reach the reader below through the gunzip stream.
  pipeline(input, gunzip).catch(() => {});
  let out = 0;
  try {
    for await (const chunk of gunzip) {
      out += (chunk as Buffer).byteLength;
      if (out > ADAPTER_MAX_BYTES) throw new UnzippedTooLarge();
      yield chunk as Buffer;
    }
  } finally {
    gunzip.destroy();
    input.destroy();
  }
}

/** A checkpoint's PEFT files as a tar: its exact length and a stream of it, made as read. */
export interface AdapterTar {
  bytes: number;
  open(): Readable;
}

/** 512-byte header, then the data padded to 512; two zero blocks end the archive. */
const tarBytes = (sizes: number[]) =>
  sizes.reduce((n, size) => n + 512 + Math.ceil(size / 512) * 512, 0) + 1024;

/** Whether a stored checkpoint's adapter trains the output head (`lm_head` in its config). */
export async function adapterTrainsHead(blobs: BlobStore, prefix: string): Promise<boolean> {
  const config = await blobs.get(`${prefix}adapter_config.json`);
  if (!config) return false;
  try {
    const targets = (JSON.parse(config.toString("utf8")) as { target_modules?: unknown })
      .target_modules;
    return Array.isArray(targets) && targets.includes("lm_head");
  } catch {
    return false;
  }
}

/**
 * The adapter files of `checkpoint` as a tar, streamed from the blob store, never built whole:
 * under a folder `label/`, or (`tinker`) at the archive's root followed by an empty
 * `checkpoint_complete`, as the `tinker` SDK's checkpoint download reads them (ADR 71).
 */
export async function checkpointAdapterTar(
  blobs: BlobStore,
  checkpoint: Pick<Checkpoint, "blob_key" | "step" | "created_at">,
  label: string,
  options: { tinker?: boolean } = {},
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
    bytes: tarBytes([...entries.map((e) => e.size), ...(options.tinker ? [0] : [])]),
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
            const header = {
              name: options.tinker ? name : `${label}/${name}`,
              size,
              mtime,
              mode: 0o644,
            };
            const entry = pack.entry(header, (err) => (err ? fail(err) : resolve()));
            entry.on("error", fail);
            source.on("error", fail);
            source.pipe(entry as unknown as NodeJS.WritableStream);
          });
        }
        if (options.tinker && !gone())
          await new Promise<void>((resolve, reject) =>
            pack.entry({ name: "checkpoint_complete", size: 0, mtime, mode: 0o644 }, "", (err) =>
              err ? reject(err) : resolve(),
            ),
          );
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
  /** The uploaded files, each as its bytes or as the blocks they arrived in (joined on the
   * checking thread); they move to that thread (transferred: unusable after). */
  files: Record<string, Uint8Array | readonly Uint8Array[]>;
  /** Aborted when the upload's client has gone: the check stops, nothing is stored. */
  signal?: AbortSignal;
}

/**
 * Adds a PEFT adapter trained elsewhere as the model's next checkpoint: checked against the
 * base on the adapter check's thread (AdapterError → InvalidInputError naming the field or
 * tensor), stored as F32 under PEFT's names with this base's id, files first, then the row;
 * nothing stays behind on any failure. A delete of the model waits for it (withModelFiles); one
 * that came first makes it a 404.
 */
export function importAdapter(store: Store, input: ImportAdapterInput): Promise<Checkpoint> {
  return withModelFiles(input.model.id, "write", () => addAdapter(store, input));
}

async function addAdapter(store: Store, input: ImportAdapterInput): Promise<Checkpoint> {
  const { model, baseConfig, files } = input;
  const active = await activeJobOf(store, model.entity, model.id);
  if (active) {
    throw new ConflictError(
      `Training job ${active.job.id} of this model is ${active.status}; upload when it has ended.`,
      { code: "job_in_progress" },
    );
  }
  const checked = await checker.check(files, baseConfig, model.base_model, input.signal);
  const named = checked.named;
  if (named !== "" && !sameBase(named, model.base_model)) {
    throw invalid(
      `adapter_config.json: base_model_name_or_path is ${quote(named)}, but this model's base is ${quote(model.base_model)}.`,
      "base_model_name_or_path",
    );
  }
  input.signal?.throwIfAborted();
  const blobs = store.blobs;
  const step = (model.latest_step ?? 0) + 1;
  let prefix: string | undefined;
  try {
    prefix = await writeCheckpointFiles(blobs, model.id, step, checked.files);
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

interface Check {
  files: Record<string, Uint8Array<ArrayBuffer>[]>;
  config: ModelConfig;
  baseId: string;
  resolve: (checked: { named: string; files: CheckpointFiles }) => void;
  reject: (err: unknown) => void;
}

/**
 * One thread, started by the first upload, that reads each adapter's files, checks them against
 * the base and writes them again as this base's F32 files: parsing the header, widening and
 * checking every weight and writing the file never hold up the server's event loop. Uploads are
 * checked one at a time, in order, so at most one adapter is being widened at once; an upload
 * whose client has gone is dropped from the queue.
 */
class AdapterChecker {
  #worker: Worker | undefined;
  readonly #queue: Check[] = [];
  #current: Check | undefined;

  check(
    files: ImportAdapterInput["files"],
    config: ModelConfig,
    baseId: string,
    signal: AbortSignal | undefined,
  ): Promise<{ named: string; files: CheckpointFiles }> {
    signal?.throwIfAborted();
    return new Promise((resolve, reject) => {
      const check: Check = {
        // The files move to the thread: transferred, not copied.
        files: Object.fromEntries(
          Object.entries(files).map(([name, bytes]) => [
            name,
            (bytes instanceof Uint8Array ? [bytes] : bytes).map(ownBuffer),
          ]),
        ),
        config,
        baseId,
        resolve: (checked) => {
          signal?.removeEventListener("abort", drop);
          resolve(checked);
        },
        reject: (err) => {
          signal?.removeEventListener("abort", drop);
          reject(err);
        },
      };
      const drop = () => {
        const queued = this.#queue.indexOf(check);
        if (queued >= 0) this.#queue.splice(queued, 1);
        // One being checked runs to its end; its answer is not waited for.
        check.reject(signal?.reason);
      };
      signal?.addEventListener("abort", drop, { once: true });
      this.#queue.push(check);
      this.#next();
    });
  }

  #next(): void {
    if (this.#current) return;
    const check = this.#queue.shift();
    if (!check) {
      this.#worker?.unref();
      return;
    }
    this.#current = check;
    const worker = this.#start();
    worker.ref();
    worker.postMessage(
      { files: check.files, config: check.config, baseId: check.baseId },
      Object.values(check.files).flatMap((blocks) => blocks.map((bytes) => bytes.buffer)),
    );
  }

  #start(): Worker {
    if (this.#worker) return this.#worker;
    const worker = new Worker(new URL("./adapter-thread.ts", import.meta.url));
    worker.on(
      "message",
      (
        answer:
          | { named: string; files: CheckpointFiles }
          | { refused: { message: string; param: string } }
          | { failed: string },
      ) => {
        const check = this.#current;
        this.#current = undefined;
        if ("refused" in answer)
          check?.reject(invalid(answer.refused.message, answer.refused.param));
        else if ("failed" in answer) check?.reject(new Error(answer.failed));
        else check?.resolve(answer);
        this.#next();
      },
    );
    const lost = (err: Error) => {
      if (this.#worker !== worker) return;
      this.#worker = undefined;
      const check = this.#current;
      this.#current = undefined;
      check?.reject(err);
      this.#next();
    };
    worker.on("error", lost);
    worker.on("exit", (code) =>
      lost(new Error(`the adapter check's thread exited (code ${code})`)),
    );
    this.#worker = worker;
    return worker;
  }
}

const checker = new AdapterChecker();

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
