import { readConfig } from "@arbor/config";
import { buildServer } from "./server.ts";

/** Reads the configuration from the environment, builds and starts the server, and shuts it
 * down gracefully on SIGINT/SIGTERM. What stops it from starting (a port in use, a data
 * directory it cannot write, a database it cannot reach, a bad setting) ends the process with
 * one line on stderr and exit code 1, never a stack trace or a server that claims to listen. */
export async function serve(): Promise<void> {
  let server: Awaited<ReturnType<typeof buildServer>>;
  let dataDir: string | undefined;
  try {
    const config = readConfig();
    dataDir = config.dataDir;
    server = await buildServer(config);
  } catch (err) {
    cannotStart(startupReason(err, dataDir));
  }
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
    await server.close().catch(() => {});
    cannotStart(reason);
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

function cannotStart(reason: string): never {
  process.stderr.write(`arbor: cannot start: ${reason}\n`);
  process.exit(1);
}

/** What went wrong before the server could listen, said in terms of the setting to change. */
function startupReason(err: unknown, dataDir: string | undefined): string {
  const e = err as NodeJS.ErrnoException & { address?: string; port?: number };
  switch (e.code) {
    case "EACCES":
    case "EROFS":
    case "EPERM":
    case "ENOTDIR":
    case "ENOENT":
      // Only a file under the data directory is the data directory's fault.
      if (e.path && dataDir && (e.path === dataDir || e.path.startsWith(`${dataDir}/`)))
        return `cannot write ${e.path} (${e.code}): set ARBOR_DATA_DIR to a directory this user can write`;
      return `cannot read or write ${e.path ?? "a file"} (${e.code})`;
    case "ECONNREFUSED":
    case "ENOTFOUND":
    case "ETIMEDOUT":
    case "EAI_AGAIN":
      return `cannot reach the database${e.address ? ` at ${e.address}${e.port ? `:${e.port}` : ""}` : ""} (${e.code}): check DATABASE_URL`;
  }
  const message = err instanceof Error ? err.message : String(err);
  return message.split("\n")[0]!;
}
