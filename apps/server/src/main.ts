import { pino } from "pino";
import { createApp } from "./app.ts";
import { configFromEnv } from "./config.ts";
import { loadSpec } from "./http/openapi.ts";
import { timed } from "./modules/health/service.ts";

const config = configFromEnv();
const logger = pino({ level: config.logLevel });
const notYet = (what: string) => () =>
  timed(async () => {
    throw new Error(`${what} is not configured yet`);
  });

const app = createApp({
  config,
  logger,
  spec: loadSpec(),
  probes: { database: notYet("database"), queue: notYet("queue"), engine: notYet("engine") },
});

const server = app.listen(config.port, config.host, () => {
  const address = server.address();
  const port = typeof address === "object" && address ? address.port : config.port;
  logger.info({ port }, `Arbor listening on http://${config.host}:${port} (docs at /docs)`);
});

function shutdown(signal: string) {
  logger.info({ signal }, "shutting down");
  server.close(() => process.exit(0));
  setTimeout(() => process.exit(1), 10_000).unref();
}
process.on("SIGINT", () => shutdown("SIGINT"));
process.on("SIGTERM", () => shutdown("SIGTERM"));
