/**
 * llama.cpp's own quality of Q8_0, as the reference for the engine's int8 weights: the KL
 * divergence of the next-token distributions of the engine's Q8_0 GGUF export from those of its
 * F32 export, both run by llama.cpp (node-llama-cpp's prebuilt CPU build), over the repository's
 * README tokenized by llama.cpp, scored as `llama-perplexity --kl-divergence` scores: chunks of
 * n_ctx tokens (the first a BOS where the model has one), the second half of each chunk scored.
 *
 *   node bench/llama-q8-kld.ts [--chunks 4]
 *
 * Models: the shipped tiny-chat, and SmolLM2-135M's shape with random weights (the folder
 * family-shapes.ts builds, BF16; both GGUFs are exported from the weights as loaded).
 */
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { catalogModelDir, exportGguf, loadModel } from "@arbor/engine/model";
import type { Token } from "node-llama-cpp";
import {
  buildShapeFolder,
  folderOf,
  prebuiltLlama,
  SHAPES,
  shapeFolderIsCurrent,
} from "./family-shapes.ts";

const { values } = parseArgs({ options: { chunks: { type: "string", default: "4" } } });
const CHUNKS = Number(values.chunks);
const text = readFileSync(new URL("../README.md", import.meta.url), "utf8");

const llama = await prebuiltLlama();

/** Log-softmax of every scored position's logits, chunk by chunk, as llama.cpp computes them. */
async function logProbs(path: string, vocab: number, nCtx: number): Promise<Float64Array[]> {
  const model = await llama.loadModel({ modelPath: path, gpuLayers: 0 });
  try {
    const tokens = model.tokenize(text);
    const bos = model.tokens.bos;
    const context = await model.createContext({ contextSize: nCtx, sequences: 1, batchSize: nCtx });
    const sequence = context.getSequence();
    const rows: Float64Array[] = [];
    const chunks = Math.min(CHUNKS, Math.floor(tokens.length / nCtx));
    for (let c = 0; c < chunks; c++) {
      await sequence.clearHistory();
      const chunk = tokens.slice(c * nCtx, (c + 1) * nCtx);
      if (bos !== null) chunk[0] = bos;
      const first = nCtx / 2;
      const results = await sequence.controlledEvaluate(
        chunk.map((token, i) =>
          i >= first && i < nCtx - 1
            ? ([token, { generateNext: { logits: true } }] as const)
            : (token as Token),
        ) as never,
      );
      for (let i = first; i < nCtx - 1; i++) {
        const row = new Float64Array(vocab);
        for (const [token, logit] of results[i]!.next.logits!) row[token as number] = logit;
        let max = -Infinity;
        for (const x of row) max = Math.max(max, x);
        let sum = 0;
        for (const x of row) sum += Math.exp(x - max);
        const log = Math.log(sum) + max;
        for (let v = 0; v < vocab; v++) row[v] = row[v]! - log;
        rows.push(row);
      }
    }
    return rows;
  } finally {
    await model.dispose();
  }
}

interface Row {
  model: string;
  n_ctx: number;
  scored: number;
  mean_kld: string;
  "±": string;
  median_kld: string;
  "99% kld": string;
  max_kld: string;
  "same top %": string;
  "f32 MB": string;
  "q8_0 MB": string;
}

async function measure(name: string, dir: string, nCtx: number): Promise<Row> {
  const model = await loadModel(dir);
  const work = mkdtempSync(join(tmpdir(), "arbor-q8-kld-"));
  try {
    const f32 = join(work, "f32.gguf");
    const q8 = join(work, "q8_0.gguf");
    await exportGguf(model, f32, name);
    await exportGguf(model, q8, name, "q8_0");
    const vocab = model.config.vocabSize;
    const base = await logProbs(f32, vocab, nCtx);
    const quant = await logProbs(q8, vocab, nCtx);
    const kld = base.map((p, i) => {
      const q = quant[i]!;
      let s = 0;
      for (let v = 0; v < vocab; v++) s += Math.exp(p[v]!) * (p[v]! - q[v]!);
      return s;
    });
    const argmax = (r: Float64Array) => r.indexOf(Math.max(...r));
    const same = base.filter((p, i) => argmax(p) === argmax(quant[i]!)).length;
    const mean = kld.reduce((a, b) => a + b, 0) / kld.length;
    const sd = Math.sqrt(kld.reduce((a, b) => a + (b - mean) ** 2, 0) / (kld.length - 1));
    const sorted = [...kld].sort((a, b) => a - b);
    const mb = (p: string) => (readFileSync(p).length / 1e6).toFixed(1);
    return {
      model: name,
      n_ctx: nCtx,
      scored: kld.length,
      mean_kld: mean.toExponential(2),
      "±": (sd / Math.sqrt(kld.length)).toExponential(1),
      median_kld: sorted[Math.floor(sorted.length / 2)]!.toExponential(2),
      "99% kld": sorted[Math.floor(sorted.length * 0.99)]!.toExponential(2),
      max_kld: sorted.at(-1)!.toExponential(2),
      "same top %": ((100 * same) / kld.length).toFixed(2),
      "f32 MB": mb(f32),
      "q8_0 MB": mb(q8),
    };
  } finally {
    rmSync(work, { recursive: true, force: true });
  }
}

console.log(`llama.cpp (node-llama-cpp, ${llama.buildType} build), Q8_0 vs F32, README.md:`);
const rows: Row[] = [];
rows.push(await measure("tiny-chat", catalogModelDir("arbor/tiny-chat"), 256));
console.table(rows);
const smol = SHAPES.find((s) => s.key === "smol")!;
if (!shapeFolderIsCurrent(smol)) await buildShapeFolder(smol);
rows.push(await measure(`${smol.name} (random)`, folderOf(smol), 512));
console.table(rows);
