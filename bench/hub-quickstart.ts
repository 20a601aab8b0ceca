/**
 * The README's second quick start, timed: a SmolLM2-135M-Instruct folder as `arbor models pull`
 * leaves it, fine-tuned by the real service on examples/data/json-answers.jsonl (200 examples,
 * batch 8, LoRA as the service chooses for a base of its size), one epoch, on 1 and on 2 engine
 * threads.
 *
 * The Hub is not reachable from our machines, so the folder is SmolLM2-135M's shape with random
 * weights (family-shapes.ts: its config.json values, BF16, and a stand-in tokenizer of its
 * vocabulary size with its ChatML specials and chat template). The compute per token is the real
 * model's; the token counts are the stand-in tokenizer's.
 *
 * Each thread count runs in a server process of its own (this file with `--serve`: the real
 * server as `serve()` builds it, with its embedded worker, ARBOR_ENGINE_THREADS set), a fresh data
 * directory and the folder under its base-models directory as HuggingFaceTB/SmolLM2-135M-Instruct.
 * Per run: the epoch's training time (the server's own clock: `training_started` →
 * `training_ended`), the wall time from the create call (the base model loaded, the data
 * tokenized), the tokens trained (the steps' `num_tokens`), and the server's peak RSS.
 *
 * Usage: node bench/hub-quickstart.ts [--threads 1,2] [--epochs 1]
 */
import { cpSync, mkdirSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { availableParallelism, loadavg, tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { buildShapeFolder, folderOf, SHAPES, shapeFolderIsCurrent } from "./family-shapes.ts";
import {
  clientOf,
  type ServerInfo,
  sec,
  serveBench,
  startChild,
  stopChild,
  table,
  timedJob,
} from "./service-children.ts";

const SELF = fileURLToPath(import.meta.url);
const REPO = "HuggingFaceTB/SmolLM2-135M-Instruct";
const DATA = fileURLToPath(new URL("../examples/data/json-answers.jsonl", import.meta.url));
const BATCH = 8;

const { values: args } = parseArgs({
  options: {
    serve: { type: "string" },
    threads: { type: "string", default: "1,2" },
    epochs: { type: "string", default: "1" },
  },
});

interface ServeSpec {
  dataDir: string;
  modelsDir: string;
  threads: number;
}

/** Child: the server with its embedded worker; prints {port, apiKey}, then its peak RSS on exit. */
async function serve(spec: ServeSpec): Promise<void> {
  await serveBench(
    {
      dataDir: spec.dataDir,
      worker: true,
      env: { ARBOR_BASE_MODELS_DIR: spec.modelsDir, ARBOR_ENGINE_THREADS: `${spec.threads}` },
    },
    () => {
      process.stdout.write(
        `${JSON.stringify({ maxRssMb: process.resourceUsage().maxRSS / 1024 })}\n`,
      );
    },
  );
}

interface Run {
  threads: number;
  training: number;
  wall: number;
  steps: number;
  tokens: number;
  rssMb: number;
  load: string;
}

async function run(modelsDir: string, threads: number, epochs: number): Promise<Run> {
  const dataDir = mkdtempSync(join(tmpdir(), "arbor-bench-hub-"));
  const loadBefore = loadavg()[0]!.toFixed(2);
  const { child, info, lines } = await startChild<ServerInfo>(SELF, "--serve", {
    dataDir,
    modelsDir,
    threads,
  } satisfies ServeSpec);
  try {
    const client = clientOf(info);
    const model = await client.training.models.create({
      project: "hub",
      name: "json",
      base_model: REPO,
    });
    const dataset = await client.training.datasets.create(readFileSync(DATA, "utf8"), {
      name: "json-answers",
    });
    let steps = 0;
    let tokens = 0;
    const times = await timedJob(
      client,
      async () =>
        await client.training.jobs.createSft({
          model_id: model.id,
          training_data_url: dataset.url,
          config: { epochs, batch_size: BATCH },
        }),
      (event) => {
        if (event.type !== "gradient_step") return;
        steps++;
        tokens += Number(event.data.num_tokens ?? 0);
      },
    );
    await stopChild(child);
    const rss = lines.map((line) => JSON.parse(line) as { maxRssMb?: number }).at(-1)?.maxRssMb;
    return {
      threads,
      training: times.training,
      wall: times.endedArrival,
      steps,
      tokens,
      rssMb: rss ?? Number.NaN,
      load: `${loadBefore} → ${loadavg()[0]!.toFixed(2)}`,
    };
  } finally {
    await stopChild(child);
    rmSync(dataDir, { recursive: true, force: true });
  }
}

async function main(): Promise<void> {
  const shape = SHAPES.find((s) => s.key === "smol")!;
  if (!shapeFolderIsCurrent(shape)) {
    console.error(`building the ${shape.name} folder (random weights, BF16)…`);
    await buildShapeFolder(shape);
  }
  const modelsDir = mkdtempSync(join(tmpdir(), "arbor-bench-hub-models-"));
  const folder = join(modelsDir, REPO);
  mkdirSync(folder, { recursive: true });
  for (const file of [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
  ]) {
    cpSync(join(folderOf(shape), file), join(folder, file));
  }
  const epochs = Number(args.epochs);
  const runs: Run[] = [];
  try {
    for (const threads of args.threads.split(",").map(Number)) {
      const r = await run(modelsDir, threads, epochs);
      console.error(`${threads} thread(s): epoch ${sec(r.training / epochs)} s`);
      runs.push(r);
    }
  } finally {
    rmSync(modelsDir, { recursive: true, force: true });
  }
  console.log(
    `\n${REPO} (${shape.name} shape, random BF16 weights), examples/data/json-answers.jsonl ` +
      `(200 examples), batch ${BATCH}, ${epochs} epoch(s), ${availableParallelism()} cores:\n`,
  );
  console.log(
    table(
      [
        "engine threads",
        "s per epoch (training)",
        "wall s (create → ended)",
        "steps",
        "tokens",
        "tokens/s",
        "peak RSS GB",
        "load avg (1 min)",
      ],
      runs.map((r) => [
        r.threads,
        sec(r.training / epochs),
        sec(r.wall),
        r.steps,
        r.tokens,
        Math.round(r.tokens / (r.training / 1000)),
        (r.rssMb / 1024).toFixed(2),
        r.load,
      ]),
    ),
  );
}

if (args.serve) await serve(JSON.parse(args.serve) as ServeSpec);
else await main();
