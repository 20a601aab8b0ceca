import { readFileSync } from "node:fs";
import { docsHtmlPath } from "@arbor/docs";
import { type Request, type Response, Router } from "express";

/** Paths that belong to the API, the console or the server, never to the docs page (besides
 * the spec's own paths). */
const SERVER_PREFIXES = /^\/(v1|call|console|docs|metrics|openapi|favicon)(\/|$|\.|_)/;

import { type OpenApiDocument, specYamlPath } from "../../http/openapi.ts";
import { docsPolicy, withPolicy } from "../../http/security-headers.ts";

/** `/docs`, `/openapi.json` and `/openapi.yaml`: public, outside the validated API. */
export function publicDocuments(spec: OpenApiDocument): Router {
  const router = Router();
  const json = JSON.stringify(spec);
  const apiPaths = new Set(Object.keys((spec as { paths?: object }).paths ?? {}));
  const yaml = readFileSync(specYamlPath, "utf8");
  let html: string | undefined;
  let policy = "";
  router.get("/openapi.json", (_req, res) => {
    res.type("application/json").send(json);
  });
  router.get("/openapi.yaml", (_req, res) => {
    res.type("application/yaml").send(yaml);
  });
  const page = (_req: Request, res: Response) => {
    try {
      if (html === undefined) {
        html = readFileSync(docsHtmlPath, "utf8");
        policy = docsPolicy(html);
      }
    } catch {
      res
        .status(503)
        .type("text/plain")
        .send("The docs are not built yet: run `pnpm --filter @arbor/docs build`.");
      return;
    }
    withPolicy(res, policy).type("text/html").send(html);
  };
  router.get(["/docs", "/docs/"], page);
  // The page routes by path: its sidebar links to `/<tag>` and `/<tag>/<operation>` at the
  // root. A browser opening such a link (a new tab, a reload) gets the page, which shows that
  // section; API paths and API clients (which do not ask for HTML first) are never answered so.
  router.get(/^\/[a-z0-9-]+(\/[a-z0-9-]+)*$/, (req, res, next) => {
    if (
      SERVER_PREFIXES.test(req.path) ||
      apiPaths.has(req.path) ||
      req.accepts(["application/json", "text/html"]) !== "text/html"
    )
      return next();
    // The same URL answers an API client otherwise: caches must tell them apart.
    res.vary("Accept");
    page(req, res);
  });
  return router;
}
