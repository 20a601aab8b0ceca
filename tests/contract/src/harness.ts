import type { AddressInfo } from "node:net";
import { type ArborClient, type ArborClientOptions, createArborClient } from "@arbor/client";
import { createApp, defaultAppConfig, loadSpec, timed } from "@arbor/server";
import { pino } from "pino";

export interface RunningServer {
  baseUrl: string;
  /** A client for this server; `maxRetries: 0` so a test sees each answer as sent. */
  client(options?: Partial<ArborClientOptions>): ArborClient;
  /** A client with the first admin's key. */
  authorizedClient(options?: Partial<ArborClientOptions>): ArborClient;
  /** The operations this server answers 501 for. */
  pending: string[];
  close(): Promise<void>;
}

/** Starts the real app on port 0 with real dependencies. */
export async function startServer(): Promise<RunningServer> {
  const spec = loadSpec();
  const app = createApp({
    config: defaultAppConfig(),
    logger: pino({ level: "silent" }),
    spec,
    probes: {
      database: () => timed(async () => ({})),
      queue: () => timed(async () => ({})),
      engine: () => timed(async () => ({})),
    },
  });
  const server = app.listen(0, "127.0.0.1");
  await new Promise<void>((resolve) => server.once("listening", () => resolve()));
  const { port } = server.address() as AddressInfo;
  const baseUrl = `http://127.0.0.1:${port}`;
  return {
    baseUrl,
    pending: app.locals.pendingOperations as string[],
    client: (options = {}) => createArborClient({ baseUrl, maxRetries: 0, ...options }),
    authorizedClient: (options = {}) => createArborClient({ baseUrl, maxRetries: 0, ...options }),
    close: () =>
      new Promise<void>((resolve, reject) => {
        server.closeAllConnections();
        server.close((err) => (err ? reject(err) : resolve()));
      }),
  };
}
