/**
 * The native training API (ADR 57) over HTTP: what each operation kind costs beyond the compute
 * it wraps, as ART's client sees it.
 *
 * Usage: node bench/native-runs.ts [--repeats 5] [--poll-ms 100]
 *
 * The real server (`buildServer`, embedded worker) in a child process (this file with `--serve`),
 * temp SQLite data dir, first admin key, on 127.0.0.1 port 0. One run of tiny-chat (rank 4 on
 * every linear and the head, as ART asks) takes --repeats rounds of: forward and forward_backward
 * (cross-entropy, 4 reversal examples as 4 matrices), optim_step, save_weights_for_sampler (into
 * a model), save_state, load_state (the state just saved, optimizer restored). Each operation is
 * submitted, polled every --poll-ms (ART polls every 100 ms) until it has ended, then its result
 * fetched, one at a time:
 * - total: from just before the POST to the result in hand;
 * - compute: the operation's own `started_at` → `ended_at` (the server's clock, ms);
 * - overhead: total − compute (admission, the worker picking it up, the poll's granularity, the
 *   result's fetch).
 * Medians over the repeats, in ms, as a Markdown table.
 */
import { randomUUID } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { cpus, loadavg, tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { createArborClient } from "@arbor/client";
import { catalogModelDir, HEAD_TARGET, LORA_TARGETS, loadModel } from "@arbor/engine/model";
import { startBenchServer } from "./server.ts";
import { median, onShutdown, startChild, stopChild, table } from "./service-children.ts";

const SELF = fileURLToPath(import.meta.url);
const BASE = "arbor/tiny-chat";
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

const { values: args } = parseArgs({
  options: {
    serve: { type: "string" },
    repeats: { type: "string", default: "5" },
    "poll-ms": { type: "string", default: "100" },
  },
});

interface Operation {
  operation_id: string;
  status: string;
  started_at: string | null;
  ended_at: string | null;
  error: { code: string } | null;
}

/** Child: the API server with the embedded worker; prints {port, apiKey}. */
async function serve(dataDir: string): Promise<void> {
  const server = await startBenchServer({ dataDir, worker: true });
  process.stdout.write(`${JSON.stringify({ port: server.port, apiKey: server.apiKey })}\n`);
  onShutdown(() => server.close());
}

/** JSON over /v1 with the admin key; throws on a non-2xx answer. */
function api(baseUrl: string, apiKey: string) {
  return async <T>(method: "GET" | "POST", path: string, body?: unknown): Promise<T> => {
    const response = await fetch(`${baseUrl}/v1${path}`, {
      method,
      headers: {
        authorization: `Bearer ${apiKey}`,
        ...(body === undefined ? {} : { "content-type": "application/json" }),
      },
      ...(body === undefined ? {} : { body: JSON.stringify(body) }),
    });
    const text = await response.text();
    if (!response.ok) throw new Error(`${method} ${path}: ${response.status} ${text}`);
    return JSON.parse(text) as T;
  };
}

/** SFT examples of word reversal as one dense TokenMatrix each (labels on the reply only). */
async function reversalBatch(words: readonly string[]) {
  const { chat } = await loadModel(catalogModelDir(BASE));
  const dense = (name: string, dtype: string, shape: number[], data: number[]) => ({
    name,
    dtype,
    shape,
    values: { encoding: "dense", data },
  });
  return {
    kind: "token_matrix",
    routes: [],
    matrices: words.map((word, i) => {
      const { tokens, mask } = chat.trainingTokens(
        [
          { role: "user", content: `Reverse the word ${word}.` },
          { role: "assistant", content: [...word].reverse().join("") },
        ],
        () => true,
      );
      const T = tokens.length;
      return {
        kind: "matrix",
        matrix_id: `example-${i}`,
        packing_affinity_id: null,
        rows: [
          dense("token_ids", "int64", [T], tokens),
          dense("target_token_ids", "int64", [T, 1], [...tokens.slice(1), 0]),
          dense("loss_weights", "float32", [T, 1], [...Array.from(mask.slice(1)), 0]),
        ],
      };
    }),
  };
}

async function main(): Promise<void> {
  const repeats = Number(args.repeats);
  const pollMs = Number(args["poll-ms"]);
  const dataDir = mkdtempSync(join(tmpdir(), "arbor-bench-native-"));
  const { child, info } = await startChild<{ port: number; apiKey: string }>(SELF, "--serve", {
    dataDir,
  });
  try {
    const call = api(`http://127.0.0.1:${info.port}`, info.apiKey);
    const model = await createArborClient({
      baseUrl: `http://127.0.0.1:${info.port}`,
      apiKey: info.apiKey,
    }).training.models.create({ project: "bench", name: `native-${Date.now()}`, base_model: BASE });
    const alias = `${model.entity}/${model.project}/${model.name}`;
    const run = await call<{ run_id: string }>("POST", "/training/runs:resolve", {
      request_id: `resolve-${randomUUID()}`,
      spec: {
        base_model: BASE,
        dtype: "bfloat16",
        lora_rank: 4,
        lora_target_modules: [...LORA_TARGETS, HEAD_TARGET].sort(),
        seed: null,
      },
      initial_state: null,
    });
    const batch = await reversalBatch(["cat", "dog", "bird", "horse"]);
    const loss = { name: "cross_entropy", normalize_advantages: false };
    let sequence = 0;
    /** Submits one command and polls it to its end, then fetches its result. */
    const timed = async (kind: string, body: Record<string, unknown>) => {
      const t0 = performance.now();
      let op = await call<Operation>("POST", `/training/runs/${run.run_id}/${kind}`, {
        request_id: `${kind}-${randomUUID()}`,
        sequence_id: sequence++,
        ...body,
      });
      while (!TERMINAL.has(op.status)) {
        await new Promise((resolve) => setTimeout(resolve, pollMs));
        op = await call<Operation>(
          "GET",
          `/training/runs/${run.run_id}/operations/${op.operation_id}`,
        );
      }
      if (op.status !== "succeeded") throw new Error(`${kind} ${op.status}: ${op.error?.code}`);
      const result = await call<{ checkpoint?: { checkpoint_id: string } }>(
        "GET",
        `/training/runs/${run.run_id}/operations/${op.operation_id}/result`,
      );
      const total = performance.now() - t0;
      const compute = Date.parse(op.ended_at!) - Date.parse(op.started_at!);
      return { total, compute, result };
    };
    const forward = {
      batch,
      loss,
      collect_packing_shapes: false,
      retain_packed_input: false,
      return_token_logprobs: false,
    };
    const times = new Map<string, { total: number[]; compute: number[] }>();
    const record = (kind: string, t: { total: number; compute: number }) => {
      const entry = times.get(kind) ?? { total: [], compute: [] };
      entry.total.push(t.total);
      entry.compute.push(t.compute);
      times.set(kind, entry);
    };
    for (let r = 0; r < repeats; r++) {
      record("forward", await timed("forward", forward));
      record("forward_backward", await timed("forward_backward", forward));
      record(
        "optim_step",
        await timed("optim_step", {
          optimizer: {
            learning_rate: 1e-3,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-13,
            weight_decay: 0.1,
            grad_clip_norm: 0.1,
          },
        }),
      );
      record(
        "save_weights_for_sampler",
        await timed("save_weights_for_sampler", {
          checkpoint_name: `sampler-${r}`,
          ttl_seconds: null,
          publication: { target: "saved_generation", model_alias: alias },
        }),
      );
      const saved = await timed("save_state", {
        checkpoint_name: `state-${r}`,
        ttl_seconds: null,
        overwrite: false,
      });
      record("save_state", saved);
      record(
        "load_state",
        await timed("load_state", {
          restore_optimizer: true,
          source: {
            kind: "service_checkpoint",
            checkpoint_id: saved.result.checkpoint!.checkpoint_id,
          },
        }),
      );
    }
    const rows = [...times].map(([kind, { total, compute }]) => {
      const overheads = total.map((t, i) => t - compute[i]!);
      return [
        `\`${kind}\``,
        median(total).toFixed(0),
        median(compute).toFixed(0),
        median(overheads).toFixed(0),
      ];
    });
    console.log(
      `native training API on ${BASE}, medians of ${repeats} repeats, polled every ${pollMs} ms; ` +
        `${cpus().length} cores, load average ${loadavg()
          .map((l) => l.toFixed(1))
          .join(" ")}\n`,
    );
    console.log(
      table(
        ["operation", "total ms (POST → result)", "compute ms (started → ended)", "overhead ms"],
        rows,
      ),
    );
  } finally {
    await stopChild(child);
    rmSync(dataDir, { recursive: true, force: true });
  }
}

if (args.serve !== undefined) await serve((JSON.parse(args.serve) as { dataDir: string }).dataDir);
else await main();
