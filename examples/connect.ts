import { readFileSync } from "node:fs";
import { homedir } from "node:os";
import { join } from "node:path";
import { type ArborClient, createArborClient } from "@arbor/client";

/** A client for a running server: ARBOR_BASE_URL (default http://127.0.0.1:8080) and
 * ARBOR_API_KEY (default: the first-start key in ~/.arbor/admin.key). */
export function connect(): ArborClient {
  const apiKey =
    process.env.ARBOR_API_KEY ??
    readFileSync(
      join(process.env.ARBOR_DATA_DIR ?? join(homedir(), ".arbor"), "admin.key"),
      "utf8",
    ).trim();
  return createArborClient({
    baseUrl: process.env.ARBOR_BASE_URL ?? "http://127.0.0.1:8080",
    apiKey,
  });
}
