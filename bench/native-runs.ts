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
import { type components, type FetchResult, unwrap } from "@arbor/client";
import { catalogModelDir, HEAD_TARGET, LORA_TARGETS, loadModel } from "@arbor/engine/model";
import {
  clientOf,
  median,
  type ServerInfo,
  serveBench,
  startChild,
  stopChild,
  table,
} from "./service-children.ts";

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

type Schemas = components["schemas"];
/** What the bench reads of an operation. */
type OperationState = Pick<
  Schemas["TrainingOperation"],
  "operation_id" | "status" | "started_at" | "ended_at" | "error"
>;

/** Every linear and the head, sorted, as ART asks (the engine names them as PEFT does). */
const TARGETS = [
  ...LORA_TARGETS,
  HEAD_TARGET,
].sort() as Schemas["TrainingRunSpec"]["lora_target_modules"];

/** Child: the API server with the embedded worker; prints {port, apiKey}. */
async function serve(dataDir: string): Promise<void> {
  await serveBench({ dataDir, worker: true });
}

/** SFT examples of word reversal as one dense TokenMatrix each (labels on the reply only). */
async function reversalBatch(words: readonly string[]): Promise<Schemas["TokenMatrixBatch"]> {
  const { chat } = await loadModel(catalogModelDir(BASE));
  const dense = (
    name: string,
    dtype: Schemas["TokenRow"]["dtype"],
    shape: number[],
    data: number[],
  ): Schemas["TokenRow"] => ({
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
  const { child, info } = await startChild<ServerInfo>(SELF, "--serve", { dataDir });
  try {
    const client = clientOf(info);
    const model = await client.training.models.create({
      project: "bench",
      name: `native-${Date.now()}`,
      base_model: BASE,
    });
    const alias = `${model.entity}/${model.project}/${model.name}`;
    const run = unwrap(
      await client.POST("/v1/training/runs:resolve", {
        body: {
          request_id: `resolve-${randomUUID()}`,
          spec: {
            base_model: BASE,
            dtype: "bfloat16",
            lora_rank: 4,
            lora_target_modules: TARGETS,
            seed: null,
          },
          initial_state: null,
        },
      }),
    );
    const runPath = { params: { path: { run_id: run.run_id } } };
    const batch = await reversalBatch(["cat", "dog", "bird", "horse"]);
    const loss: Schemas["TrainingLoss"] = { name: "cross_entropy", normalize_advantages: false };
    let sequence = 0;
    const times = new Map<string, { total: number[]; compute: number[] }>();
    /** Submits one command (`submit`, given its ids), polls it to its end, fetches its result,
     * and records its times under its kind. */
    const timed = async (
      kind: Schemas["TrainingOperation"]["kind"],
      submit: (ids: {
        request_id: string;
        sequence_id: number;
      }) => Promise<FetchResult<OperationState>>,
    ) => {
      const t0 = performance.now();
      let op = unwrap(
        await submit({ request_id: `${kind}-${randomUUID()}`, sequence_id: sequence++ }),
      );
      const opPath = { params: { path: { run_id: run.run_id, operation_id: op.operation_id } } };
      while (!TERMINAL.has(op.status)) {
        await new Promise((resolve) => setTimeout(resolve, pollMs));
        op = unwrap(
          await client.GET("/v1/training/runs/{run_id}/operations/{operation_id}", opPath),
        );
      }
      if (op.status !== "succeeded") throw new Error(`${kind} ${op.status}: ${op.error?.code}`);
      const result = unwrap(
        await client.GET("/v1/training/runs/{run_id}/operations/{operation_id}/result", opPath),
      );
      const entry = times.get(kind) ?? { total: [], compute: [] };
      entry.total.push(performance.now() - t0);
      entry.compute.push(Date.parse(op.ended_at!) - Date.parse(op.started_at!));
      times.set(kind, entry);
      return result;
    };
    const forward = {
      batch,
      loss,
      collect_packing_shapes: false,
      retain_packed_input: false as const,
      return_token_logprobs: false,
    };
    for (let r = 0; r < repeats; r++) {
      await timed("forward", (ids) =>
        client.POST("/v1/training/runs/{run_id}/forward", {
          ...runPath,
          body: { ...ids, ...forward },
        }),
      );
      await timed("forward_backward", (ids) =>
        client.POST("/v1/training/runs/{run_id}/forward_backward", {
          ...runPath,
          body: { ...ids, ...forward },
        }),
      );
      await timed("optim_step", (ids) =>
        client.POST("/v1/training/runs/{run_id}/optim_step", {
          ...runPath,
          body: {
            ...ids,
            optimizer: {
              learning_rate: 1e-3,
              beta1: 0.9,
              beta2: 0.99,
              eps: 1e-13,
              weight_decay: 0.1,
              grad_clip_norm: 0.1,
            },
          },
        }),
      );
      await timed("save_weights_for_sampler", (ids) =>
        client.POST("/v1/training/runs/{run_id}/save_weights_for_sampler", {
          ...runPath,
          body: {
            ...ids,
            checkpoint_name: `sampler-${r}`,
            ttl_seconds: null,
            publication: { target: "saved_generation", model_alias: alias },
          },
        }),
      );
      const saved = await timed("save_state", (ids) =>
        client.POST("/v1/training/runs/{run_id}/save_state", {
          ...runPath,
          body: { ...ids, checkpoint_name: `state-${r}`, ttl_seconds: null, overwrite: false },
        }),
      );
      if (saved.kind !== "save_state") throw new Error(`save_state answered a ${saved.kind}`);
      await timed("load_state", (ids) =>
        client.POST("/v1/training/runs/{run_id}/load_state", {
          ...runPath,
          body: {
            ...ids,
            restore_optimizer: true,
            source: { kind: "service_checkpoint", checkpoint_id: saved.checkpoint.checkpoint_id },
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
