import express, { type RequestHandler } from "express";

/** The deepest nesting a JSON request body may have (documented in the spec's description). */
export const MAX_JSON_DEPTH = 128;

/** An error body-parser passes on with its status: a client mistake, never a 500. */
export class BodyTooDeepError extends Error {
  readonly status = 400;
  readonly expose = true;
  readonly type = "entity.too.deep";
  constructor() {
    super(`The JSON body nests deeper than ${MAX_JSON_DEPTH} levels.`);
  }
}

/**
 * Whether JSON text nests arrays and objects deeper than `max`: one pass over the bytes,
 * skipping strings. Recursive code later on (validation, hashing, storing) then never meets a
 * depth that could overflow its stack.
 */
export function nestsDeeperThan(bytes: Uint8Array, max: number): boolean {
  let depth = 0;
  let inString = false;
  for (let i = 0; i < bytes.length; i++) {
    const c = bytes[i];
    if (inString) {
      if (c === 0x5c) i++;
      else if (c === 0x22) inString = false;
    } else if (c === 0x22) inString = true;
    else if (c === 0x7b || c === 0x5b) {
      if (++depth > max) return true;
    } else if (c === 0x7d || c === 0x5d) depth--;
  }
  return false;
}

/** `express.json` with a size cap and the depth check. */
export function jsonBody(limit: string): RequestHandler {
  return express.json({
    limit,
    verify: (_req, _res, bytes) => {
      if (nestsDeeperThan(bytes, MAX_JSON_DEPTH)) throw new BodyTooDeepError();
    },
  });
}
