import type { IncomingHttpHeaders } from "node:http";
import type { Readable } from "node:stream";
import { createBrotliDecompress, createGunzip, createInflate } from "node:zlib";
import { UnavailableError } from "@arbor/store";
import { ADAPTER_MAX_BYTES } from "@arbor/training";
import type { NextFunction, Request, RequestHandler, Response } from "express";
import { ApiError } from "./errors.ts";

/**
 * What an upload may hold at most, per byte of its tar: the two files out of it, the adapter
 * widened to F32 (twice the size of a BF16 file) and the F32 files written from it, on the
 * checking thread.
 */
export const UPLOAD_BYTES_HELD = 4;

/** How long a refused upload is told to wait. Uploads take seconds. */
const RETRY_AFTER_SECONDS = 5;

/** The uploads paths: `POST /v1/preview/models/{model_id}/checkpoints` (adapters) and
 * `POST /v1/files` (OpenAI's fine-tuning files, held whole by multer until checked). */
const UPLOADS = /^\/v1\/(preview\/models\/[^/]+\/checkpoints|files)\/?$/;

/** A share of the budget taken by one upload; released once its response has closed. */
export interface UploadReservation {
  /** Grows the share to `bytes` (no further than the whole budget); false when that does not
   * fit beside the others, and the share is as it was. */
  grow(bytes: number): boolean;
  release(): void;
}

/**
 * The memory adapter uploads in progress may hold together, shared by every request of the
 * process (ADR 49): each takes its share before its body is read, and one that does not fit
 * beside the others is refused rather than queued. A share is at most the whole budget, so an
 * upload alone is always let in.
 */
export class UploadBudget {
  readonly total: number;
  #held = 0;

  constructor(total: number) {
    this.total = total;
  }

  /** Bytes held by the uploads in progress. */
  get held(): number {
    return this.#held;
  }

  take(bytes: number): UploadReservation | undefined {
    let share = 0;
    const reservation: UploadReservation = {
      grow: (wanted) => {
        const more = Math.min(wanted, this.total) - share;
        if (more <= 0) return true;
        if (this.#held + more > this.total) return false;
        this.#held += more;
        share += more;
        return true;
      },
      release: () => {
        this.#held -= share;
        share = 0;
      },
    };
    return reservation.grow(bytes) ? reservation : undefined;
  }
}

function busy(budget: UploadBudget): UnavailableError {
  return new UnavailableError(
    `Uploads in progress hold this server's memory for uploads (${budget.total} bytes, ARBOR_UPLOAD_MEMORY_BYTES); retry in ${RETRY_AFTER_SECONDS} seconds.`,
    { code: "uploads_busy", retryAfterSeconds: RETRY_AFTER_SECONDS },
  );
}

/**
 * What an upload takes of the budget, from its headers: UPLOAD_BYTES_HELD × its body, its
 * Content-Length, or the cap when it is gzipped, encoded or of unknown length (it may unzip to
 * the cap). Undefined for a tar whose Content-Length is over the cap (multipart/form-data is
 * capped per file, by the validator's multer).
 */
export function uploadShare(headers: IncomingHttpHeaders): number | undefined {
  const type = (headers["content-type"] ?? "").split(";")[0]!.trim().toLowerCase();
  const length = Number(headers["content-length"]);
  const known = headers["content-length"] !== undefined && Number.isSafeInteger(length);
  const encoded = (headers["content-encoding"] ?? "identity").toLowerCase() !== "identity";
  const tar = type === "application/x-tar" || type === "application/gzip";
  if (tar && known && !encoded && length > ADAPTER_MAX_BYTES) return undefined;
  const bytes = known && !encoded && type !== "application/gzip" ? length : ADAPTER_MAX_BYTES;
  return UPLOAD_BYTES_HELD * bytes;
}

/**
 * Admits adapter uploads within `budget`, before anything reads their body: each takes its
 * `uploadShare`, else 503 with Retry-After; a tar declared over the cap is 413 at once. The share
 * is on `res.locals.upload` and is released when the response closes.
 */
export function uploadAdmission(budget: UploadBudget): RequestHandler {
  return (req: Request, res: Response, next: NextFunction) => {
    if (req.method !== "POST" || !UPLOADS.test(req.path)) return next();
    const share = uploadShare(req.headers);
    if (share === undefined) {
      return next(ApiError.tooLarge(`Request body is over ${ADAPTER_MAX_BYTES} bytes.`));
    }
    const reservation = budget.take(share);
    if (!reservation) return next(busy(budget));
    res.locals.upload = { reservation, budget };
    res.on("close", () => reservation.release());
    next();
  };
}

/**
 * Called when an upload's tar turns out to be gzipped though it came as `application/x-tar`:
 * its share grows to what the cap unzipped may hold, or the upload is refused with 503.
 */
export function unzippingUpload(res: Response): void {
  const upload = res.locals.upload;
  if (upload && !upload.reservation.grow(UPLOAD_BYTES_HELD * ADAPTER_MAX_BYTES)) {
    throw busy(upload.budget);
  }
}

/**
 * The request's body as it arrives, its Content-Encoding undone (gzip, deflate, br) by zlib's
 * asynchronous streams (another encoding is 415), for a reader that may stop early. `drain()`
 * then reads what is left of the body and drops it, so that the answer goes out and the
 * connection serves its next request; it never destroys the request (that would close the
 * socket, with no way to answer). Chunks are taken from `data` events with the stream paused
 * in between, never through a `readable` listener, which would keep `resume()` from draining.
 */
export function uploadBody(req: Request): { chunks: AsyncIterable<Uint8Array>; drain(): void } {
  const encoding = (req.headers["content-encoding"] ?? "identity").toLowerCase();
  const decoder =
    encoding === "identity"
      ? undefined
      : encoding === "gzip" || encoding === "x-gzip"
        ? createGunzip()
        : encoding === "deflate"
          ? createInflate()
          : encoding === "br"
            ? createBrotliDecompress()
            : null;
  if (decoder === null) {
    throw new ApiError(
      415,
      `unsupported content encoding "${encoding.slice(0, 32)}": send the body uncompressed, or with gzip, deflate or br.`,
      { code: "unsupported_media_type" },
    );
  }
  const stream: Readable = decoder ? req.pipe(decoder) : req;
  const queue: Buffer[] = [];
  let ended = false;
  let failed: Error | undefined;
  let wake: (() => void) | undefined;
  const woken = () => {
    wake?.();
    wake = undefined;
  };
  const onData = (chunk: Buffer) => {
    queue.push(chunk);
    stream.pause();
    woken();
  };
  const onEnd = () => {
    ended = true;
    woken();
  };
  const onError = (err: Error) => {
    failed = err;
    woken();
  };
  stream.pause();
  stream.on("data", onData);
  stream.on("end", onEnd);
  stream.on("error", onError);
  // The request's own errors (a client gone) reach the reader through the decoder.
  if (decoder) req.on("error", onError);
  const chunks = (async function* () {
    while (true) {
      const chunk = queue.shift();
      if (chunk) {
        yield chunk;
        continue;
      }
      if (failed) throw failed;
      if (ended) return;
      const next = new Promise<void>((resolve) => {
        wake = resolve;
      });
      stream.resume();
      await next;
    }
  })();
  return {
    chunks,
    drain() {
      stream.off("data", onData);
      queue.length = 0;
      ended = true;
      woken();
      if (decoder) {
        req.unpipe(decoder);
        decoder.destroy();
      }
      if (!req.readableEnded) req.resume();
    },
  };
}

/** The block size of a multipart upload's files as they are kept. */
const BLOCK_BYTES = 4 * 1024 * 1024;

/**
 * Where the validator's multer keeps a multipart upload's files (its storage engine): each as
 * `parts`, the blocks of 4 MiB its bytes were copied into as they arrived. They are never joined
 * here, since joining hundreds of megabytes in one copy would hold up the event loop; the
 * adapter check's thread joins them.
 */
export const multipartBlocks = {
  _handleFile(
    _req: Request,
    file: { stream: Readable },
    done: (err: Error | null, info?: { parts: Uint8Array[]; size: number }) => void,
  ): void {
    const blocks: Buffer[] = [];
    let size = 0;
    file.stream.on("data", (chunk: Buffer) => {
      let from = 0;
      while (from < chunk.length) {
        const at = size % BLOCK_BYTES;
        if (at === 0) blocks.push(Buffer.allocUnsafe(BLOCK_BYTES));
        const copied = chunk.copy(blocks.at(-1)!, at, from);
        from += copied;
        size += copied;
      }
    });
    file.stream.on("error", (err: Error) => done(err));
    file.stream.on("end", () => {
      const last = size % BLOCK_BYTES;
      if (last > 0) blocks[blocks.length - 1] = blocks.at(-1)!.subarray(0, last);
      done(null, { parts: blocks, size });
    });
  },
  _removeFile(_req: Request, file: object, done: (err: Error | null) => void) {
    delete (file as { parts?: Uint8Array[] }).parts;
    done(null);
  },
};
