import type { NextFunction, Request, Response } from "express";
import { ApiError, quote } from "./errors.ts";
import type { Principal } from "./principal.ts";

/** Resolves a presented key to its principal; null for an unknown or revoked key. */
export type Authenticate = (apiKey: string) => Promise<Principal | null>;

const publicPaths = new Set(["/v1/health", "/v1/system-check"]);

/** CONTRACT §2: every endpoint needs `Authorization: Bearer <key>`, except health,
 * system-check, the docs and the spec (which are mounted before this middleware). */
export function authentication(authenticate: Authenticate) {
  return (req: Request, res: Response, next: NextFunction) => {
    if (publicPaths.has(req.path)) return next();
    const header = req.header("authorization");
    if (!header) {
      return next(
        ApiError.unauthorized("Missing API key: send `Authorization: Bearer <API key>`."),
      );
    }
    const match = /^Bearer\s+(\S+)\s*$/i.exec(header);
    if (!match?.[1]) {
      return next(
        ApiError.unauthorized("Malformed Authorization header: expected `Bearer <API key>`."),
      );
    }
    authenticate(match[1])
      .then((principal) => {
        if (!principal) return next(ApiError.unauthorized("Invalid API key."));
        res.locals.principal = principal;
        res.locals.project = projectOf(req, principal);
        next();
      })
      .catch(next);
  };
}

/** A project the principal may use: `<entity>/<project>`. */
export interface ProjectRef {
  entity: string;
  project: string;
  /** `<entity>/<project>`, as calls store it. */
  id: string;
}

const projectPattern = /^((?!\.\.?\/)[A-Za-z0-9._-]{1,128})\/((?!\.\.?$)[A-Za-z0-9._-]{1,128})$/;

export function parseProjectId(value: string): ProjectRef | null {
  const match = projectPattern.exec(value);
  if (!match) return null;
  return { entity: match[1]!, project: match[2]!, id: value };
}

/** The project header (`Compat-Project`, or its alias `OpenAI-Project`); absent →
 * `<default entity>/inference`. A malformed value → 400; a foreign entity → 403. */
function projectOf(req: Request, principal: Principal): ProjectRef {
  const raw = req.header("compat-project") ?? req.header("openai-project");
  if (raw === undefined) {
    return parseProjectId(`${principal.defaultEntity}/inference`)!;
  }
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

/** Throws 403 unless the principal is a member of `entity`. */
export function requireEntity(principal: Principal, entity: string): void {
  if (!principal.entities.includes(entity)) {
    throw ApiError.forbidden(`This API key may not act for entity ${quote(entity)}.`);
  }
}
