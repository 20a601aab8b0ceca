import { readConfig } from "@arbor/config";
import { buildServer } from "./server.ts";

/** Reads the configuration from the environment, builds and starts the server, and shuts it
 * down gracefully on SIGINT/SIGTERM. A port that cannot be bound ends the process with one line. */
export async function serve(): Promise<void> {
  const server = await buildServer(readConfig());
  const { config, logger, firstStart } = server;
  if (firstStart) {
    // Printed once: only its hash is stored. The same key is in the file, readable by this user only.
    process.stderr.write(
      `\nFirst start: created user "admin" in entity "default" with this API key (shown once):\n\n  ${firstStart.token}\n\nIt is also in ${firstStart.keyPath} (mode 0600). Use it as:\n  curl -H "Authorization: Bearer $(cat ${firstStart.keyPath})" http://${config.host}:${config.port}/v1/models\n\n`,
    );
  }
  try {
    await server.start();
  } catch (err) {
    const reason =
      (err as NodeJS.ErrnoException).code === "EADDRINUSE"
        ? `${config.host}:${config.port} is already in use (set ARBOR_PORT to another port)`
        : err instanceof Error
          ? err.message
          : String(err);
    logger.fatal({ err }, `Arbor cannot start: ${reason}`);
    process.stderr.write(`arbor: cannot start: ${reason}\n`);
    await server.close().catch(() => {});
    process.exit(1);
  }
  const port = Number(new URL(server.url!).port);
  logger.info(
    {
      port,
      dataDir: config.dataDir,
      database: server.store.dialect,
      engineThreads: config.engineThreads,
      trainingThreads: config.embeddedWorker ? config.trainingThreads : 0,
    },
    `Arbor listening on ${server.url} (docs at /docs)`,
  );

  let stopping = false;
  function shutdown(signal: string) {
    if (stopping) return;
    stopping = true;
    logger.info({ signal }, "shutting down");
    setTimeout(() => process.exit(1), 10_000).unref();
    server.close().finally(() => process.exit(0));
  }
  process.on("SIGINT", () => shutdown("SIGINT"));
  process.on("SIGTERM", () => shutdown("SIGTERM"));
}
