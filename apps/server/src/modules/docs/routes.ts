import { readFileSync } from "node:fs";
import { docsHtmlPath } from "@arbor/docs";
import { Router } from "express";
import { type OpenApiDocument, specYamlPath } from "../../http/openapi.ts";

/** `/docs`, `/openapi.json` and `/openapi.yaml`: public, outside the validated API. */
export function publicDocuments(spec: OpenApiDocument): Router {
  const router = Router();
  const json = JSON.stringify(spec);
  const yaml = readFileSync(specYamlPath, "utf8");
  let html: string | undefined;
  router.get("/openapi.json", (_req, res) => {
    res.type("application/json").send(json);
  });
  router.get("/openapi.yaml", (_req, res) => {
    res.type("application/yaml").send(yaml);
  });
  router.get(["/docs", "/docs/"], (_req, res) => {
    try {
      html ??= readFileSync(docsHtmlPath, "utf8");
    } catch {
      res
        .status(503)
        .type("text/plain")
        .send("The docs are not built yet: run `pnpm --filter @arbor/docs build`.");
      return;
    }
    res.type("text/html").send(html);
  });
  return router;
}
