import type { Readable } from "node:stream";
import { Worker } from "node:worker_threads";
import { createBrotliDecompress, createGunzip, createInflate } from "node:zlib";
import express, { type Request, type RequestHandler } from "express";
import { MAX_JSON_DEPTH, nestsDeeperThan } from "./json-depth.ts";

export { MAX_JSON_DEPTH } from "./json-depth.ts";

/** Bodies larger than this (or of unknown size, or compressed) are parsed on a worker thread. */
export const OFF_THREAD_JSON_BYTES = 1024 * 1024;

/** A body refused as body-parser refuses one: a client mistake with its status, never a 500. */
class BodyError extends Error {
  readonly status: number;
  readonly expose = true;
  readonly type: string;
  constructor(status: number, type: string, message: string) {
    super(message);
    this.status = status;
    this.type = type;
  }
}

const tooDeep = () =>
  new BodyError(
    400,
    "entity.too.deep",
    `The JSON body nests deeper than ${MAX_JSON_DEPTH} levels.`,
  );

/**
 * JSON request bodies up to `limit` bytes (decoded), checked for depth. Small ones are parsed
 * here by body-parser; large, compressed or chunked ones are streamed chunk by chunk to a
 * worker thread (inflated on the way by zlib), which joins, parses and checks them, so a 10 MB
 * body never holds up the event loop for its copy or its parse.
 */
export function jsonBody(limit: number): RequestHandler[] {
  const small = express.json({ limit });
  return [
    (req, res, next) => {
      // body-parser's mark: a body already read (by a parser mounted on a narrower path) is done.
      const marked = req as Request & { _body?: boolean };
      if (marked._body) return next();
      if (!offThread(req)) {
        small(req, res, (err?: unknown) => {
          if (err) return next(err);
          next(
            req.body !== undefined && nestsDeeperThan(req.body, MAX_JSON_DEPTH)
              ? tooDeep()
              : undefined,
          );
        });
        return;
      }
      if (!req.is("application/json")) return next();
      const charset = /;\s*charset=("?)([^";]+)\1/i.exec(req.header("content-type") ?? "")?.[2];
      if (charset && !/^utf-?8$/i.test(charset)) {
        return next(
          new BodyError(
            415,
            "charset.unsupported",
            `unsupported charset "${charset.toUpperCase().slice(0, 32)}"`,
          ),
        );
      }
      marked._body = true;
      parser.read(req, limit).then((value) => {
        req.body = value;
        next();
      }, next);
    },
  ];
}

function offThread(req: Request): boolean {
  const length = Number(req.headers["content-length"]);
  const encoding = req.headers["content-encoding"];
  return (
    !Number.isFinite(length) ||
    length > OFF_THREAD_JSON_BYTES ||
    (encoding !== undefined && encoding !== "identity")
  );
}

/** The request's body as a stream of decoded bytes, or a 415 for an encoding we cannot undo. */
function decoded(req: Request): Readable {
  const encoding = (req.headers["content-encoding"] ?? "identity").toLowerCase();
  switch (encoding) {
    case "identity":
      return req;
    case "gzip":
    case "x-gzip":
      return req.pipe(createGunzip());
    case "deflate":
      return req.pipe(createInflate());
    case "br":
      return req.pipe(createBrotliDecompress());
    default:
      throw new BodyError(
        415,
        "encoding.unsupported",
        `unsupported content encoding "${encoding.slice(0, 32)}"`,
      );
  }
}

/** One worker thread, started on the first large body, that joins, parses and depth-checks. */
class JsonParserThread {
  #worker: Worker | undefined;
  readonly #pending = new Map<
    number,
    { resolve: (v: unknown) => void; reject: (e: Error) => void }
  >();
  #next = 0;

  /** Streams the body to the thread as it arrives; resolves with the parsed value. */
  read(req: Request, limit: number): Promise<unknown> {
    return new Promise((resolve, reject) => {
      let stream: Readable;
      try {
        stream = decoded(req);
      } catch (err) {
        req.resume();
        reject(err);
        return;
      }
      const worker = this.#start();
      const id = this.#next++;
      let total = 0;
      let failed = false;
      const fail = (err: Error) => {
        if (failed) return;
        failed = true;
        this.#pending.delete(id);
        worker.postMessage({ id, drop: true });
        req.unpipe();
        req.resume();
        reject(err);
      };
      this.#pending.set(id, { resolve, reject: fail });
      worker.ref();
      stream.on("data", (chunk: Buffer) => {
        if (failed) return;
        total += chunk.byteLength;
        if (total > limit) {
          fail(new BodyError(413, "entity.too.large", "request entity too large"));
          return;
        }
        const copy = new Uint8Array(chunk);
        worker.postMessage({ id, chunk: copy }, [copy.buffer]);
      });
      stream.on("end", () => {
        if (!failed) worker.postMessage({ id, end: true });
      });
      stream.on("error", (err: NodeJS.ErrnoException) => {
        // zlib's errors keep their Z_* code: the body does not decode with its encoding.
        const error = new BodyError(400, "request.decode.failed", err.message) as BodyError & {
          code?: string;
        };
        if (err.code) error.code = err.code;
        fail(error);
      });
      req.on("aborted", () => fail(new BodyError(400, "request.aborted", "request aborted")));
    });
  }

  #start(): Worker {
    if (this.#worker) return this.#worker;
    const worker = new Worker(new URL("./json-worker.ts", import.meta.url));
    worker.unref();
    worker.on("message", (reply: { id: number; value?: unknown; error?: string }) => {
      const pending = this.#pending.get(reply.id);
      this.#pending.delete(reply.id);
      if (this.#pending.size === 0) worker.unref();
      if (!pending) return;
      if (reply.error === "entity.too.deep") pending.reject(tooDeep());
      else if (reply.error)
        pending.reject(new BodyError(400, "entity.parse.failed", "invalid JSON"));
      else pending.resolve(reply.value);
    });
    const lost = (err: Error) => {
      if (this.#worker === worker) this.#worker = undefined;
      for (const p of this.#pending.values()) p.reject(err);
      this.#pending.clear();
    };
    worker.on("error", lost);
    worker.on("exit", (code) => lost(new Error(`the JSON parser thread exited (code ${code})`)));
    this.#worker = worker;
    return worker;
  }
}

const parser = new JsonParserThread();
