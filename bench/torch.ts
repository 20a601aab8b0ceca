/**
 * Shared by the engine benches: the thread counts to measure, and PyTorch (Debian's
 * python3-torch, run with /usr/bin/python3) on the same shapes when it is installed.
 */
import { execFileSync, spawnSync } from "node:child_process";
import { writeFileSync } from "node:fs";
import { availableParallelism, tmpdir } from "node:os";
import { join } from "node:path";

/** One thread, and one per core when the machine has more. */
export const THREAD_COUNTS = [...new Set([1, availableParallelism()])];

export const TORCH_MISSING =
  "PyTorch not found: `apt-get install python3-torch libopenblas0-pthread` to compare " +
  "(without libopenblas0-pthread torch falls back to the slow reference BLAS).";

export function torchInstalled(): boolean {
  return spawnSync("/usr/bin/python3", ["-c", "import torch"]).status === 0;
}

/**
 * Runs a PyTorch script pinned to `threads` threads (torch.set_num_threads reads TORCH_THREADS;
 * OpenMP and OpenBLAS are pinned too) and parses the JSON it prints.
 */
export function runTorch<T>(name: string, script: string, args: string[], threads: number): T {
  const file = join(tmpdir(), `arbor-bench-${name}.py`);
  writeFileSync(file, script);
  const n = String(threads);
  const output = execFileSync("/usr/bin/python3", [file, ...args], {
    env: {
      ...process.env,
      TORCH_THREADS: n,
      OMP_NUM_THREADS: n,
      OPENBLAS_NUM_THREADS: n,
      MKL_NUM_THREADS: n,
    },
  });
  return JSON.parse(output.toString()) as T;
}

/** Prints a Markdown table; numbers are rounded, ratios get two decimals. */
export function printTable(header: string[], rows: (string | number | null)[][]): void {
  const cell = (v: string | number | null) =>
    v === null ? "–" : typeof v === "number" ? (Math.abs(v) < 10 ? v.toFixed(2) : v.toFixed(0)) : v;
  console.log(`| ${header.join(" | ")} |`);
  console.log(`|${header.map((_, i) => (i === 0 ? "---" : "---:")).join("|")}|`);
  for (const row of rows) console.log(`| ${row.map(cell).join(" | ")} |`);
}
