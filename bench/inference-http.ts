/**
 * What the HTTP layer adds to inference, and how streaming holds up under concurrent clients.
 *
 * Usage: node bench/inference-http.ts [--requests 100] [--streams 256] [--levels 1,8,32]
 *
 * The server (the real server, `buildServer`, default config: requests and responses validated, on
 * 127.0.0.1 port 0, temp SQLite store, first admin key, no training worker) runs in a child
 * process (this file with `--serve`), so it and the load generator each get a core of the
 * 2-core machine.
 *
 * 1. Latency: the same request (arbor/tiny-chat, one short user message, max_tokens 32,
 *    temperature 0) `--requests` times through `POST /v1/chat/completions` (non-streaming, one
 *    at a time) and `--requests` times through `engine.complete()` in this process on the same
 *    model, interleaved one by one, after 5 warm-ups each. Prints p50/p99 of each and the
 *    difference, and checks that both answer the same text.
 * 2. Streaming: for each level of concurrency, `--streams` requests ("Count from 1 to 50.",
 *    max_tokens 64, temperature 1, seed = request number, so every level gets the same requests)
 *    shared by that many clients, each streaming one request after another with
 *    `client.streamChatCompletion`. Prints time to first token (first chunk with content)
 *    p50/p99, aggregate output tokens/s (all completion tokens over the level's wall time),
 *    per-stream tokens/s (a stream's completion tokens over its own duration, median; and after
 *    its first token: (tokens − 1) over first to last content chunk) and errors. Exits 1 on any
 *    error.
 */
import { mkdtempSync, rmSync } from "node:fs";
import { cpus, loadavg, tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { catalogModelDir, loadModel } from "@arbor/engine/model";
import { Engine } from "@arbor/engine/serve";
import {
  clientOf,
  type ServerInfo,
  serveBench,
  startChild,
  stopChild,
} from "./service-children.ts";

const SELF = fileURLToPath(import.meta.url);
const MODEL = "arbor/tiny-chat";
const MESSAGES = [{ role: "user" as const, content: "What is 7 + 5?" }];
/** For the streams: one of the longer answers tiny-chat gives (it ends most answers well before
 * max_tokens with its end token; the API has no way to suppress it). */
const STREAM_MESSAGES = [{ role: "user" as const, content: "Count from 1 to 50." }];

const { values: args } = parseArgs({
  options: {
    serve: { type: "string" },
    requests: { type: "string", default: "100" },
    streams: { type: "string", default: "256" },
    levels: { type: "string", default: "1,8,32" },
  },
});

/** The child: the real app with a temp SQLite store, removed when it stops. */
async function serve(): Promise<void> {
  const dataDir = mkdtempSync(join(tmpdir(), "arbor-bench-inference-"));
  await serveBench({ dataDir }, () => rmSync(dataDir, { recursive: true, force: true }));
}

function percentile(values: number[], q: number): number {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))] ?? Number.NaN;
}
const p50 = (values: number[]) => percentile(values, 0.5);
const p99 = (values: number[]) => percentile(values, 0.99);
const ms = (value: number) => value.toFixed(2);

function table(header: string[], rows: (string | number)[][], right: boolean[]): string {
  const cells = [header, ...rows.map((r) => r.map(String))];
  const widths = header.map((_, i) => Math.max(3, ...cells.map((r) => r[i]!.length)));
  const line = (r: string[]) =>
    `| ${r.map((c, i) => (right[i] ? c.padStart(widths[i]!) : c.padEnd(widths[i]!))).join(" | ")} |`;
  const rule = `| ${widths.map((w, i) => (right[i] ? `${"-".repeat(w - 1)}:` : "-".repeat(w))).join(" | ")} |`;
  return [line(header), rule, ...cells.slice(1).map(line)].join("\n");
}

async function main(): Promise<void> {
  const requests = Number(args.requests);
  const streams = Number(args.streams);
  const levels = args.levels.split(",").map(Number);
  const load = () =>
    loadavg()
      .map((l) => l.toFixed(2))
      .join(" / ");
  console.log(
    `# inference-http: ${new Date().toISOString()}, Node ${process.version}, ${cpus().length} × ${cpus()[0]?.model ?? "?"}`,
  );
  console.log(`load average (1/5/15 min) at start: ${load()}\n`);

  const { child, info } = await startChild<ServerInfo>(SELF, "--serve", {});
  let errors = 0;
  try {
    const client = clientOf(info);
    const engine = new Engine(await loadModel(catalogModelDir(MODEL)));

    // 1. Latency, one request at a time, HTTP and in-process interleaved.
    const viaHttp = async () => {
      const start = performance.now();
      const c = await client.chat.completions.create({
        model: MODEL,
        messages: MESSAGES,
        max_tokens: 32,
        temperature: 0,
      });
      return {
        ms: performance.now() - start,
        text: c.choices[0]!.message.content ?? "",
        tokens: c.usage!.completion_tokens,
      };
    };
    const direct = async () => {
      const start = performance.now();
      const c = await engine.complete({ messages: MESSAGES, maxTokens: 32, temperature: 0 });
      return {
        ms: performance.now() - start,
        text: c.choices[0]!.text,
        tokens: c.usage.completionTokens,
      };
    };
    for (let i = 0; i < 5; i++) {
      await viaHttp();
      await direct();
    }
    const httpMs: number[] = [];
    const directMs: number[] = [];
    let httpText = "";
    let directText = "";
    let tokens = 0;
    for (let i = 0; i < requests; i++) {
      const h = await viaHttp();
      const d = await direct();
      httpMs.push(h.ms);
      directMs.push(d.ms);
      httpText = h.text;
      directText = d.text;
      tokens = d.tokens;
    }
    if (httpText !== directText) {
      console.error(
        `the HTTP answer ${JSON.stringify(httpText)} differs from the engine's ${JSON.stringify(directText)}`,
      );
      errors++;
    }
    console.log(
      `## HTTP layer over engine.complete() (${requests} requests each, one at a time, interleaved; ` +
        `${MODEL}, "${MESSAGES[0]!.content}", max_tokens 32, temperature 0 → ${tokens} tokens: ${JSON.stringify(directText)})\n`,
    );
    console.log(
      table(
        ["path", "p50 ms", "p99 ms", "mean ms"],
        [
          [
            "POST /v1/chat/completions (server in a child process)",
            ms(p50(httpMs)),
            ms(p99(httpMs)),
            ms(httpMs.reduce((a, b) => a + b, 0) / httpMs.length),
          ],
          [
            "engine.complete() in-process",
            ms(p50(directMs)),
            ms(p99(directMs)),
            ms(directMs.reduce((a, b) => a + b, 0) / directMs.length),
          ],
          [
            "HTTP layer adds",
            ms(p50(httpMs) - p50(directMs)),
            ms(p99(httpMs) - p99(directMs)),
            ms(
              (httpMs.reduce((a, b) => a + b, 0) - directMs.reduce((a, b) => a + b, 0)) / requests,
            ),
          ],
        ],
        [false, true, true, true],
      ),
    );
    console.log(`\nload average after: ${load()}\n`);

    // 2. Streaming under 1, 8, 32 concurrent clients.
    const rows: (string | number)[][] = [];
    for (const level of levels) {
      // Warm-up: one stream per client, not counted.
      await Promise.all(
        Array.from({ length: level }, async (_, i) => {
          for await (const _chunk of await client.chat.completions.create({
            model: MODEL,
            messages: STREAM_MESSAGES,
            max_tokens: 8,
            temperature: 1,
            seed: 1_000_000 + i,
            stream: true,
          })) {
            // drain
          }
        }),
      );
      const ttft: number[] = [];
      const perStream: number[] = [];
      const decode: number[] = [];
      let total = 0;
      let failed = 0;
      let next = 0;
      const loadBefore = loadavg()[0]!;
      const start = performance.now();
      await Promise.all(
        Array.from({ length: level }, async () => {
          for (let n = next++; n < streams; n = next++) {
            const t0 = performance.now();
            let first = Number.NaN;
            let last = Number.NaN;
            let completion = 0;
            try {
              for await (const chunk of await client.chat.completions.create({
                model: MODEL,
                messages: STREAM_MESSAGES,
                max_tokens: 64,
                temperature: 1,
                seed: n,
                stream_options: { include_usage: true },
                stream: true,
              })) {
                if (Number.isNaN(first) && chunk.choices[0]?.delta.content) {
                  first = performance.now() - t0;
                }
                if (chunk.choices[0]?.delta.content) last = performance.now() - t0;
                if (chunk.usage) completion = chunk.usage.completion_tokens;
              }
              if (completion === 0 || Number.isNaN(first)) {
                throw new Error("the stream ended without content or usage");
              }
              ttft.push(first);
              total += completion;
              perStream.push(completion / ((performance.now() - t0) / 1000));
              if (completion > 1 && last > first)
                decode.push((completion - 1) / ((last - first) / 1000));
            } catch (err) {
              failed++;
              console.error(`stream ${n} at concurrency ${level}: ${(err as Error).message}`);
            }
          }
        }),
      );
      const wall = (performance.now() - start) / 1000;
      errors += failed;
      rows.push([
        level,
        streams,
        ms(p50(ttft)),
        ms(p99(ttft)),
        Math.round(total / wall),
        Math.round((streams - failed) / wall),
        Math.round(p50(perStream)),
        Math.round(p50(decode)),
        (total / (streams - failed)).toFixed(1),
        wall.toFixed(2),
        `${loadBefore.toFixed(2)} → ${loadavg()[0]!.toFixed(2)}`,
        failed,
      ]);
    }
    console.log(
      `## Streaming (${streams} requests per level shared by the clients; "${STREAM_MESSAGES[0]!.content}", max_tokens 64, temperature 1, seed = request number)\n`,
    );
    console.log(
      table(
        [
          "clients",
          "requests",
          "TTFT p50 ms",
          "TTFT p99 ms",
          "aggregate tokens/s",
          "requests/s",
          "per-stream tokens/s (p50)",
          "per-stream after first token (p50)",
          "tokens/request",
          "wall s",
          "load avg (1 min)",
          "errors",
        ],
        rows,
        [true, true, true, true, true, true, true, true, true, true, false, true],
      ),
    );
  } finally {
    await stopChild(child);
  }
  if (errors > 0) {
    console.error(`\n${errors} error(s): the numbers above measure failures too`);
    process.exit(1);
  }
}

if (args.serve !== undefined) await serve();
else await main();
