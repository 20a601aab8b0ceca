/**
 * The engine's q8 weights (ADR 61) against its BF16 ones and llama.cpp's Q8_0 on the same
 * weights, side by side in one run, on the families' shapes (random weights, bench/family-shapes.ts):
 * - tokens/s of a 128-token prefill and of decoding (1 sequence), one thread and two: the three
 *   take turns, round after round, each keeping its best (the machine is shared); on one thread
 *   also per second of the process's CPU time, which a loaded machine disturbs far less;
 * - quality: the mean KL divergence of q8's next-token distributions from BF16's over a fixed
 *   text (the shape's tokenizer), and top-1 agreement;
 * - LoRA-SFT on a q8 base against a BF16 one: tokens/s and peak RSS (each in its own process).
 * llama.cpp's file is the engine's own GGUF export in Q8_0 (`exportGguf(…, "q8_0")`), from the
 * weights as loaded.
 * Usage: node bench/engine-q8.ts [shape keys, default smol] [--rounds N] [--no-train]
 */
import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { loadavg } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { createWasmKernels, type Kernels } from "@arbor/engine/kernels";
import {
  createKvCache,
  distributionDistance,
  exportGguf,
  forwardBatch,
  loadModel,
  type Model,
  positionLogits,
  QUALITY_TEXT,
  Rng,
  releaseKvCache,
} from "@arbor/engine/model";
import { type SftConfig, type SftExample, trainSft } from "@arbor/engine/train";
import type { Token } from "node-llama-cpp";
import {
  buildShapeFolder,
  folderOf,
  prebuiltLlama,
  SEED,
  SHAPES,
  type Shape,
  shapeFolderIsCurrent,
} from "./family-shapes.ts";
import { printTable } from "./torch.ts";

const SELF = fileURLToPath(import.meta.url);
const PROMPT = 128;
const DECODE = 32;
const THREADS = [1, 2];
const args = process.argv.slice(2);
const flag = (name: string) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : undefined;
};
const ROUNDS = Number(flag("--rounds") ?? 3);
const maxRssMb = () => process.resourceUsage().maxRSS / 1024;
const q8GgufOf = (shape: Shape) => join(folderOf(shape), "model-q8_0.gguf");
const load = () =>
  loadavg()
    .map((v) => v.toFixed(1))
    .join(" ");

interface Rates {
  prefill: number;
  decode: number;
  /** Tokens per second of this process's CPU time (all its threads): robust to a loaded machine
   * on one thread, where the process runs nothing else meanwhile. */
  cpuPrefill: number;
  cpuDecode: number;
}

/** CPU seconds of the whole process (every thread) since `from`. */
const cpuSince = (from: NodeJS.CpuUsage) => {
  const d = process.cpuUsage(from);
  return (d.user + d.system) / 1e6;
};

function argmax(values: Float32Array): number {
  let best = 0;
  for (let v = 1; v < values.length; v++) if (values[v]! > values[best]!) best = v;
  return best;
}

/** A PROMPT-token prefill, then DECODE greedy steps, of one sequence. */
function engineRun(model: Model, kernels: Kernels, rng: Rng): Rates {
  const V = model.config.vocabSize;
  const cache = createKvCache(model, PROMPT + DECODE, kernels);
  const tokens = Array.from({ length: PROMPT }, () => rng.int(V));
  const c0 = process.cpuUsage();
  const t0 = performance.now();
  let next = argmax(forwardBatch(model, kernels, [{ cache, tokens }])[0]!);
  const t1 = performance.now();
  const c1 = process.cpuUsage();
  for (let step = 0; step < DECODE; step++) {
    next = argmax(forwardBatch(model, kernels, [{ cache, tokens: [next] }])[0]!);
  }
  const t2 = performance.now();
  const cpuDecode = cpuSince(c1);
  const cpuPrefill = cpuSince(c0) - cpuDecode;
  releaseKvCache(cache);
  return {
    prefill: PROMPT / ((t1 - t0) / 1000),
    decode: DECODE / ((t2 - t1) / 1000),
    cpuPrefill: PROMPT / cpuPrefill,
    cpuDecode: DECODE / cpuDecode,
  };
}

async function llamaRunner(shape: Shape, threads: number) {
  const llama = await prebuiltLlama(threads);
  const model = await llama.loadModel({ modelPath: q8GgufOf(shape), gpuLayers: 0 });
  const context = await model.createContext({
    contextSize: 256,
    sequences: 1,
    threads: { ideal: threads, min: threads },
    batchSize: 512,
  });
  const sequence = context.getSequence();
  const V = shape.config.vocab_size as number;
  await sequence.evaluateWithoutGeneratingNewTokens([1, 2, 3, 4, 5, 6, 7, 8] as unknown as Token[]);
  return {
    async run(rng: Rng): Promise<Rates> {
      await sequence.clearHistory();
      const prompt = Array.from({ length: PROMPT }, () => rng.int(V)) as unknown as Token[];
      const c0 = process.cpuUsage();
      const t0 = performance.now();
      await sequence.evaluateWithoutGeneratingNewTokens(prompt);
      const t1 = performance.now();
      const c1 = process.cpuUsage();
      const generator = sequence.evaluate([prompt.at(-1)!], {
        temperature: 0,
        yieldEogToken: true,
      });
      let generated = 0;
      for (let step = 0; step < DECODE; step++) if (!(await generator.next()).done) generated++;
      await generator.return();
      const t2 = performance.now();
      const cpuDecode = cpuSince(c1);
      const cpuPrefill = cpuSince(c0) - cpuDecode;
      return {
        prefill: PROMPT / ((t1 - t0) / 1000),
        decode: generated / ((t2 - t1) / 1000),
        cpuPrefill: PROMPT / cpuPrefill,
        cpuDecode: generated / cpuDecode,
      };
    },
    async dispose() {
      await context.dispose();
      await model.dispose();
    },
  };
}

async function inference(shape: Shape) {
  const rows: (string | number | null)[][] = [];
  for (const threads of THREADS) {
    const kernels = {
      bf16: createWasmKernels("auto", { threads }),
      q8: createWasmKernels("auto", { threads }),
    };
    const models = {
      bf16: await loadModel(folderOf(shape), { kernels: kernels.bf16, weights: "bf16" }),
      q8: await loadModel(folderOf(shape), { kernels: kernels.q8, weights: "q8" }),
    };
    let llama: Awaited<ReturnType<typeof llamaRunner>> | null = null;
    let llamaError = "";
    try {
      llama = await llamaRunner(shape, threads);
    } catch (err) {
      llamaError = (err as Error).message;
    }
    const zero = (): Rates => ({ prefill: 0, decode: 0, cpuPrefill: 0, cpuDecode: 0 });
    const best = { bf16: zero(), q8: zero(), llama: zero() };
    const keep = (into: Rates, r: Rates) => {
      for (const key of Object.keys(into) as (keyof Rates)[])
        into[key] = Math.max(into[key], r[key]);
    };
    const rng = new Rng(SEED + threads);
    for (const dtype of ["bf16", "q8"] as const) engineRun(models[dtype], kernels[dtype], rng);
    for (let round = 0; round < ROUNDS; round++) {
      for (const dtype of ["bf16", "q8"] as const) {
        keep(best[dtype], engineRun(models[dtype], kernels[dtype], rng));
      }
      if (llama) keep(best.llama, await llama.run(rng));
    }
    // By CPU time on one thread only: on two, helpers spinning for work count as CPU.
    const keys =
      threads === 1
        ? (["prefill", "decode", "cpuPrefill", "cpuDecode"] as const)
        : (["prefill", "decode"] as const);
    for (const key of keys) {
      const l = llama ? best.llama[key] : null;
      const what = {
        prefill: `prefill ${PROMPT}`,
        decode: "decode",
        cpuPrefill: `prefill ${PROMPT}, by CPU time`,
        cpuDecode: "decode, by CPU time",
      }[key];
      rows.push([
        `${shape.name}, ${threads} thread${threads > 1 ? "s" : ""}, ${what}`,
        best.bf16[key],
        best.q8[key],
        l,
        best.q8[key] / best.bf16[key],
        l ? best.q8[key] / l : null,
      ]);
    }
    if (llamaError) console.log(`llama.cpp not run: ${llamaError}`);
    await llama?.dispose();
    await Promise.all([kernels.bf16.close(), kernels.q8.close()]);
  }
  return rows;
}

async function quality(shape: Shape) {
  const kernels = createWasmKernels("auto", { threads: 2 });
  const bf16 = await loadModel(folderOf(shape), { kernels, weights: "bf16" });
  const q8 = await loadModel(folderOf(shape), { kernels, weights: "q8" });
  const tokens = bf16.tokenizer.encode(QUALITY_TEXT, { special: false }).slice(0, 256);
  const d = distributionDistance(
    positionLogits(bf16, kernels, tokens),
    positionLogits(q8, kernels, tokens),
  );
  await kernels.close();
  return [shape.name, d.positions, d.meanKld.toExponential(2), d.maxKld.toExponential(2), d.top1];
}

const WORDS =
  "the a of and to in is it that was for on are with as his they be at one have this from or had by word but what some we can out other were all there when up use your how said an each she which do their time if will way about many then them write would like so these her long make thing see him two has look more day could go come did number".split(
    " ",
  );

function examples(count: number): SftExample[] {
  const rng = new Rng(SEED);
  const words = (n: number) => Array.from({ length: n }, () => WORDS[rng.int(WORDS.length)]!);
  return Array.from({ length: count }, () => {
    const n = 55 + rng.int(40);
    return {
      messages: [
        { role: "user", content: `Say this again in other words: ${words(n).join(" ")}.` },
        { role: "assistant", content: `${words(n + 20).join(" ")}.` },
      ],
    };
  });
}

/** A child's job: LoRA-SFT steps on the shape's base in `dtype`; prints tokens/s and peak RSS. */
async function trainJob(shape: Shape, dtype: "bf16" | "q8", threads: number) {
  const kernels = createWasmKernels("auto", { threads });
  const model = await loadModel(folderOf(shape), { kernels, weights: dtype });
  const config: SftConfig = {
    batchSize: "auto",
    tokensPerStep: 512,
    learningRate: 1e-4,
    lora: { rank: 8, alpha: 16 },
    seed: SEED,
  };
  const steps: { tokens: number; seconds: number }[] = [];
  const stop = new Error("enough");
  const controller = new AbortController();
  try {
    await trainSft(model, examples(12), config, {
      kernels,
      signal: controller.signal,
      onStep: ({ metrics }) => {
        steps.push({
          tokens: metrics.num_tokens,
          seconds: metrics.num_tokens / metrics.tokens_per_second,
        });
        if (steps.length >= 4) controller.abort(stop);
      },
    });
  } catch (err) {
    if (err !== stop) throw err;
  }
  const measured = steps.slice(1);
  const tokens = measured.reduce((n, s) => n + s.tokens, 0);
  const seconds = measured.reduce((n, s) => n + s.seconds, 0);
  console.log(JSON.stringify({ tokens_per_s: tokens / seconds, max_rss_mb: maxRssMb() }));
  await kernels.close();
}

function child(
  jobArgs: string[],
): { tokens_per_s: number; max_rss_mb: number } | { error: string } {
  const r = spawnSync(process.execPath, [SELF, ...jobArgs], {
    encoding: "utf8",
    maxBuffer: 64 << 20,
  });
  const line = (r.stdout ?? "")
    .split("\n")
    .filter((l) => l.startsWith("{"))
    .at(-1);
  if (r.status !== 0 || !line)
    return { error: `exit ${r.status}: ${(r.stderr ?? "").slice(-300)}` };
  return JSON.parse(line);
}

async function main() {
  if (args[0] === "--train-job") {
    const shape = SHAPES.find((s) => s.key === args[1])!;
    await trainJob(shape, args[2] as "bf16" | "q8", Number(args[3]));
    return;
  }
  const keys = args.filter((a, i) => !a.startsWith("--") && !args[i - 1]?.startsWith("--rounds"));
  const shapes = SHAPES.filter((s) => (keys.length ? keys : ["smol"]).includes(s.key));
  console.log(`\nload average at start: ${load()} (${process.env.HOSTNAME ?? "this machine"})`);
  const speed: (string | number | null)[][] = [];
  const quals: (string | number | null)[][] = [];
  const train: (string | number | null)[][] = [];
  for (const shape of shapes) {
    if (!shapeFolderIsCurrent(shape)) await buildShapeFolder(shape);
    if (!existsSync(q8GgufOf(shape))) {
      // From the weights as loaded, as the F32 GGUF beside it: the engine's own Q8_0 export.
      await exportGguf(await loadModel(folderOf(shape)), q8GgufOf(shape), shape.name, "q8_0");
    }
    speed.push(...(await inference(shape)));
    quals.push(await quality(shape));
    if (!args.includes("--no-train") && shape.train) {
      // Alternating processes, best of two each: tokens/s and peak RSS of a whole process.
      const results = {
        bf16: [] as ReturnType<typeof child>[],
        q8: [] as ReturnType<typeof child>[],
      };
      for (let i = 0; i < 2; i++)
        for (const dtype of ["bf16", "q8"] as const)
          results[dtype].push(child(["--train-job", shape.key, dtype, "2"]));
      const best = (dtype: "bf16" | "q8") => {
        const ok = results[dtype].filter(
          (r): r is { tokens_per_s: number; max_rss_mb: number } => !("error" in r),
        );
        if (ok.length === 0) return null;
        return {
          tps: Math.max(...ok.map((r) => r.tokens_per_s)),
          rss: Math.min(...ok.map((r) => r.max_rss_mb)),
        };
      };
      const [b, q] = [best("bf16"), best("q8")];
      for (const r of [...results.bf16, ...results.q8]) if ("error" in r) console.log(r.error);
      train.push([
        `${shape.name}, 2 threads`,
        b?.tps ?? null,
        q?.tps ?? null,
        b && q ? q.tps / b.tps : null,
        b?.rss ?? null,
        q?.rss ?? null,
        b && q ? q.rss / b.rss : null,
      ]);
    }
  }
  console.log("\nTokens/s, one sequence, best of each side's rounds (taken in turns):\n");
  printTable(
    ["case", "engine BF16", "engine q8", "llama.cpp Q8_0", "q8 / BF16", "q8 / llama.cpp"],
    speed,
  );
  console.log("\nq8 against BF16, next-token distributions over a fixed text (bench tokenizer):\n");
  printTable(["shape", "positions", "mean KLD", "max KLD", "top-1 agreement"], quals);
  if (train.length) {
    console.log("\nLoRA-SFT (rank 8, 512-token steps), q8 base against BF16 base:\n");
    printTable(
      [
        "shape",
        "BF16 tokens/s",
        "q8 tokens/s",
        "q8 / BF16",
        "BF16 peak RSS MB",
        "q8 peak RSS MB",
        "q8 / BF16 RSS",
      ],
      train,
    );
  }
  console.log(`\nload average at end: ${load()}`);
}

await main();
