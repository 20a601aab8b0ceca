import { readFileSync } from "node:fs";
import { homedir } from "node:os";
import { join } from "node:path";
import { type ArborClient, createArborClient } from "@arbor/client";

/**
 * Where the server is, as the `arbor` command finds it: ARBOR_BASE_URL, or else where the
 * server's own ARBOR_HOST and ARBOR_PORT put it (default http://127.0.0.1:8080).
 */
export function serverUrl(env: NodeJS.ProcessEnv = process.env): string {
  if (env.ARBOR_BASE_URL) return env.ARBOR_BASE_URL;
  const configured = env.ARBOR_HOST ?? "127.0.0.1";
  // A server listening on every interface is reached on this machine's loopback.
  const host = configured === "0.0.0.0" || configured === "::" ? "127.0.0.1" : configured;
  return `http://${host.includes(":") ? `[${host}]` : host}:${env.ARBOR_PORT ?? 8080}`;
}

/** A client for a running server (see `serverUrl`), with ARBOR_API_KEY (default: the
 * first-start key in ARBOR_DATA_DIR/admin.key, ~/.arbor/admin.key by default). */
export function connect(env: NodeJS.ProcessEnv = process.env): ArborClient {
  const apiKey =
    env.ARBOR_API_KEY ??
    readFileSync(join(env.ARBOR_DATA_DIR ?? join(homedir(), ".arbor"), "admin.key"), "utf8").trim();
  return createArborClient({ baseUrl: serverUrl(env), apiKey });
}
