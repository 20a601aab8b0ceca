/** Joins, parses and depth-checks large JSON request bodies off the server's thread (see
 * `jsonBody`): chunks arrive as the body does, the parse runs at its end. */
import { parentPort } from "node:worker_threads";
import { MAX_JSON_DEPTH, nestsDeeperThan } from "./json-depth.ts";

const decoder = new TextDecoder("utf-8");
const bodies = new Map<number, Uint8Array[]>();

type Message =
  | { id: number; chunk: Uint8Array }
  | { id: number; end: true }
  | { id: number; drop: true };

parentPort?.on("message", (message: Message) => {
  if ("chunk" in message) {
    const chunks = bodies.get(message.id) ?? [];
    chunks.push(message.chunk);
    bodies.set(message.id, chunks);
    return;
  }
  const chunks = bodies.get(message.id) ?? [];
  bodies.delete(message.id);
  if ("drop" in message) return;
  parentPort?.postMessage({ id: message.id, ...parse(Buffer.concat(chunks)) });
});

function parse(bytes: Uint8Array): { value: unknown } | { error: string } {
  let value: unknown;
  try {
    const text = decoder.decode(bytes);
    // As body-parser's strict mode: only an object or an array is a body.
    if (!/^\s*[{[]/.test(text.slice(0, 64))) throw new SyntaxError("not an object or array");
    value = JSON.parse(text);
  } catch {
    return { error: "entity.parse.failed" };
  }
  return nestsDeeperThan(value, MAX_JSON_DEPTH) ? { error: "entity.too.deep" } : { value };
}
