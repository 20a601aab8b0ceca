import { existsSync } from "node:fs";
import { join } from "node:path";
import { consoleDir } from "@arbor/console";
import express, { Router } from "express";
import { CONSOLE_POLICY, withPolicy } from "../../http/security-headers.ts";

/**
 * `/console`: the web console's static files (public: it signs in with an API key and calls
 * the same API as every client), `/` sends a browser there, and `/favicon.ico` answers for
 * pages such as `/docs` that ask for one. `/console/hints.json` tells the sign-in page where the
 * first admin key was written, when that is safe to show (`adminKeyPath` null otherwise).
 */
export function consoleRoutes(adminKeyPath: string | null): Router {
  const router = Router();
  const index = join(consoleDir, "index.html");
  router.get("/", (_req, res) => res.redirect(302, "/console/"));
  router.get("/favicon.ico", (_req, res) => {
    res.type("image/svg+xml").sendFile(join(consoleDir, "favicon.svg"), (err) => {
      if (err) res.status(404).end();
    });
  });
  router.get("/console/hints.json", (_req, res) => {
    res.setHeader("cache-control", "no-cache");
    res.json({ admin_key_path: adminKeyPath });
  });
  router.use(
    "/console",
    // Hashed assets never change; index.html always revalidates.
    express.static(consoleDir, {
      index: "index.html",
      setHeaders: (res, path) => {
        withPolicy(res, CONSOLE_POLICY);
        res.setHeader(
          "cache-control",
          path.includes("/assets/") ? "public, max-age=31536000, immutable" : "no-cache",
        );
      },
    }),
  );
  router.get("/console/", (_req, res) => {
    if (!existsSync(index)) {
      res
        .status(503)
        .type("text/plain")
        .send("The console is not built yet: run `pnpm --filter @arbor/console build`.");
      return;
    }
    withPolicy(res, CONSOLE_POLICY).sendFile(index);
  });
  return router;
}
