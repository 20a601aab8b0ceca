/**
 * Generates the WebAssembly text of the kernel table (`src/kernels/table.ts`) in four builds,
 * relaxed-SIMD FMA or plain SIMD on a wasm32 or a Memory64 arena, and assembles each with wabt
 * into a committed binary (`pnpm run build:wasm` after changing a kernel; installing the
 * package needs no toolchain, and a test checks the committed binaries are what this builds).
 */
import { writeFile } from "node:fs/promises";
import wabtInit from "wabt";
import { KERNEL_NAMES, KERNELS } from "../src/kernels/table.ts";
import { MAX_PAGES, MAX_PAGES_64 } from "../src/kernels/wasm/arena.ts";
import { expFunction } from "../src/kernels/wasm/bodies.ts";
import {
  type Madd,
  type MemoryModel,
  plainMadd,
  relaxedMadd,
  type Wat,
  wat,
} from "../src/kernels/wasm/wat.ts";

/** The module of one build: the shared memory, the `$exp` helper, then every kernel in order. */
export function moduleText(w: Wat): string {
  const limits = w.memory === "memory64" ? `i64 1 ${MAX_PAGES_64}` : `1 ${MAX_PAGES}`;
  return `(module
  (memory (import "env" "memory") ${limits} shared)
  ${expFunction(w)}
  ${KERNEL_NAMES.map((name) => w.func(name, KERNELS[name].params, KERNELS[name].body(w))).join("\n  ")})`;
}

/** The four builds, by file name. */
const BUILDS: Record<string, [Madd, MemoryModel]> = {
  "kernels-relaxed.wasm": [relaxedMadd, "wasm32"],
  "kernels-simd.wasm": [plainMadd, "wasm32"],
  "kernels-relaxed-64.wasm": [relaxedMadd, "memory64"],
  "kernels-simd-64.wasm": [plainMadd, "memory64"],
};

/** The four kernel binaries, by file name: relaxed or plain SIMD, on a wasm32 or memory64 arena. */
export async function assemble(): Promise<Record<string, Uint8Array>> {
  const wabt = await wabtInit();
  const built: Record<string, Uint8Array> = {};
  for (const [file, [madd, memory]] of Object.entries(BUILDS)) {
    const features = {
      simd: true,
      relaxed_simd: true,
      threads: true,
      memory64: memory === "memory64",
    };
    const parsed = wabt.parseWat(
      file.replace(".wasm", ".wat"),
      moduleText(wat(memory, madd)),
      features,
    );
    // wabt's types omit validate's feature argument; without it, shared memory is rejected.
    (parsed.validate as (f: typeof features) => void)(features);
    built[file] = new Uint8Array(parsed.toBinary({}).buffer);
  }
  return built;
}

if (import.meta.main) {
  const dir = new URL("../src/kernels/wasm/", import.meta.url);
  for (const [file, bytes] of Object.entries(await assemble())) {
    await writeFile(new URL(file, dir), bytes);
    console.log(`wrote ${file} (${bytes.length} B)`);
  }
}
