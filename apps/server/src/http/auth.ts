import { quote } from "@arbor/store";
import type { NextFunction, Request, Response } from "express";
import {
  defaultProject,
  type Principal,
  type ProjectRef,
  parseProjectId,
  requireEntity,
} from "../modules/access.ts";
import { ApiError } from "./errors.ts";

/** Resolves a presented key to its principal; null for an unknown or revoked key. */
export type Authenticate = (apiKey: string) => Promise<Principal | null>;

/** Every operation needs `Authorization: Bearer <key>` except those the spec marks
 * `security: []` (`publicPaths`), and the docs and the spec, mounted before this middleware.
 * It runs before any body is read, so an unauthenticated request costs no parsing. */
export function authentication(authenticate: Authenticate, publicPaths: ReadonlySet<string>) {
  return (req: Request, res: Response, next: NextFunction) => {
    if (publicPaths.has(req.path)) return next();
    let token: string;
    try {
      token = bearerToken(req);
    } catch (err) {
      return next(err);
    }
    authenticate(token)
      .then((principal) => {
        if (!principal) return next(ApiError.unauthorized("Invalid API key."));
        res.locals.principal = principal;
        res.locals.project = projectOf(req, principal);
        next();
      })
      .catch(next);
  };
}

/** The key of `Authorization: Bearer <key>`; a missing or malformed header is a 401. */
export function bearerToken(req: Request): string {
  const header = req.header("authorization");
  if (!header) {
    throw ApiError.unauthorized("Missing API key: send `Authorization: Bearer <API key>`.");
  }
  const match = /^Bearer\s+(\S+)\s*$/i.exec(header);
  if (!match?.[1]) {
    throw ApiError.unauthorized("Malformed Authorization header: expected `Bearer <API key>`.");
  }
  return match[1];
}

/** The project header (`Compat-Project`, or its alias `OpenAI-Project`); absent →
 * `<default entity>/inference`. A malformed value → 400; a foreign entity → 403. */
function projectOf(req: Request, principal: Principal): ProjectRef {
  const raw = req.header("compat-project") ?? req.header("openai-project");
  if (raw === undefined) return defaultProject(principal);
  const ref = parseProjectId(raw.trim());
  if (!ref) {
    throw ApiError.badRequest(
      `Malformed project header ${quote(raw)}: expected "<entity>/<project>".`,
      "Compat-Project",
      "invalid_project",
    );
  }
  requireEntity(principal, ref.entity);
  return ref;
}
