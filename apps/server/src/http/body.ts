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
 * Whether a parsed JSON value nests arrays and objects deeper than `max`, walked without
 * recursion: the walk visits nodes, not bytes, so a body that is one long string costs nothing.
 * Recursive code later on (validation, hashing, storing) then never meets a depth that could
 * overflow its stack.
 */
export function nestsDeeperThan(value: unknown, max: number): boolean {
  const stack: [unknown, number][] = [[value, 1]];
  while (stack.length > 0) {
    const [node, depth] = stack.pop()!;
    if (typeof node !== "object" || node === null) continue;
    if (depth > max) return true;
    const children = Array.isArray(node) ? node : Object.values(node);
    for (const child of children) {
      if (typeof child === "object" && child !== null) stack.push([child, depth + 1]);
    }
  }
  return false;
}

/** `express.json` with a size cap, then the depth check on what it parsed. */
export function jsonBody(limit: string): RequestHandler[] {
  return [
    express.json({ limit }),
    (req, _res, next) => {
      next(
        req.body !== undefined && nestsDeeperThan(req.body, MAX_JSON_DEPTH)
          ? new BodyTooDeepError()
          : undefined,
      );
    },
  ];
}
