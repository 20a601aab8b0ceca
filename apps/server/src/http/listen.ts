import { createServer, type Server, STATUS_CODES } from "node:http";
import type { Socket } from "node:net";
import { uuidv7 } from "@arbor/store";
import type { Express } from "express";
import { ApiError, envelope, surfaceOf } from "./errors.ts";

/**
 * Listens with the app on `port` (0 for any) and `host`. Resolves once the socket is bound, and
 * rejects when it cannot be (a port in use, say): a server never claims to listen when it does
 * not. Requests that Node's HTTP parser refuses before Express sees them (a bad Content-Length,
 * an unknown Transfer-Encoding, oversized headers) are answered in the surface's envelope with
 * an `x-request-id`, like every other error.
 */
export function listen(app: Express, port: number, host: string): Promise<Server> {
  const server = createServer(app);
  server.on("clientError", (err: NodeJS.ErrnoException & { rawPacket?: Buffer }, socket) =>
    answerUnparsable(err, socket as Socket),
  );
  return new Promise((resolve, reject) => {
    const failed = (err: Error) => reject(err);
    server.once("error", failed);
    server.listen(port, host, () => {
      server.off("error", failed);
      resolve(server);
    });
  });
}

function answerUnparsable(
  err: NodeJS.ErrnoException & { rawPacket?: Buffer },
  socket: Socket,
): void {
  if (err.code === "ECONNRESET" || !socket.writable) {
    socket.destroy();
    return;
  }
  const status =
    err.code === "HPE_HEADER_OVERFLOW" ? 431 : err.code === "ERR_HTTP_REQUEST_TIMEOUT" ? 408 : 400;
  const path = /^[A-Z]+ (\S+)/.exec(err.rawPacket?.toString("latin1") ?? "")?.[1] ?? "/";
  const requestId = uuidv7();
  const { body } = envelope(
    surfaceOf(path),
    new ApiError(status, "The request is not valid HTTP/1.1 (its request line or headers).", {
      code: "invalid_http",
    }),
    requestId,
  );
  const json = JSON.stringify(body);
  socket.end(
    `HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\ncontent-type: application/json\r\n` +
      `x-request-id: ${requestId}\r\ncontent-length: ${Buffer.byteLength(json)}\r\n` +
      `connection: close\r\n\r\n${json}`,
  );
}
