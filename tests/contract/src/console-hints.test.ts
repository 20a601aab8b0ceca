import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";

/** `/console/hints.json`: what the public sign-in page may say about where the key is (ADR 67). */
const servers: RunningServer[] = [];
afterAll(async () => {
  for (const s of servers) await s.close();
});

async function hints(env: Record<string, string>) {
  const server = await startServer({}, { env });
  servers.push(server);
  const res = await fetch(`${server.baseUrl}/console/hints.json`);
  return { server, status: res.status, body: await res.json() };
}

describe("console hints", () => {
  it("when the server listens on loopback, then the key file of its data directory is named", async () => {
    const { server, status, body } = await hints({});
    expect(status).toBe(200);
    expect(body).toEqual({ admin_key_path: join(server.dataDir, "admin.key") });
  });

  it("when the server listens on every address, then no path is given", async () => {
    const { status, body } = await hints({ ARBOR_HOST: "0.0.0.0" });
    expect(status).toBe(200);
    expect(body).toEqual({ admin_key_path: null });
  });
});
