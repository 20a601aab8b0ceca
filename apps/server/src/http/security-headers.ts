import { createHash } from "node:crypto";
import type { RequestHandler, Response } from "express";
import helmet from "helmet";

/**
 * Headers on every response: content types are never sniffed, no referrer leaves, nothing of
 * this server is framed by another site (the console's delete and prune buttons), and an API
 * answer, which is never a page, may load nothing. The console and the docs page set their
 * own policy (`consolePolicy`, `docsPolicy`). HSTS is left to the TLS proxy in front, which
 * knows whether the host is served over HTTPS only.
 */
export function securityHeaders(): RequestHandler {
  return helmet({
    contentSecurityPolicy: {
      useDefaults: false,
      directives: { defaultSrc: ["'none'"], frameAncestors: ["'none'"], baseUri: ["'none'"] },
    },
    strictTransportSecurity: false,
    xFrameOptions: { action: "deny" },
    referrerPolicy: { policy: "no-referrer" },
    // The API is called from other origins' pages and tools: its answers may be read there.
    crossOriginResourcePolicy: { policy: "cross-origin" },
  });
}

const common = [
  "default-src 'self'",
  "connect-src 'self'",
  "img-src 'self' data:",
  "object-src 'none'",
  "base-uri 'none'",
  "form-action 'self'",
  "frame-ancestors 'none'",
];

/** The console: its own scripts and styles only (a Vite build with no inline code). */
export const CONSOLE_POLICY = [...common, "script-src 'self'", "style-src 'self'"].join("; ");

/**
 * The docs page (Redoc, built into one file): its inline scripts by hash; styles inline, as
 * Redoc's styled components inject them at run time; its icon font inline; its search worker
 * from a blob.
 */
export function docsPolicy(html: string): string {
  const hashes = [...html.matchAll(/<script(?![^>]*\bsrc=)[^>]*>([\s\S]*?)<\/script>/g)].map(
    (m) => `'sha256-${createHash("sha256").update(m[1]!).digest("base64")}'`,
  );
  return [
    ...common,
    `script-src 'self' ${hashes.join(" ")}`,
    "style-src 'self' 'unsafe-inline'",
    "font-src 'self' data:",
    "worker-src 'self' blob:",
  ].join("; ");
}

/** Sends a page under `policy`, replacing the API's. */
export function withPolicy(res: Response, policy: string): Response {
  return res.setHeader("Content-Security-Policy", policy);
}
