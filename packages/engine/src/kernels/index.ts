/**
 * `@arbor/engine/kernels`: the compute kernels (WebAssembly SIMD, their arena and helper
 * threads, the plain-JS reference). The lowest layer: it imports nothing of the others.
 */
export { jsKernels } from "./js.ts";
export type { Kernels } from "./types.ts";
export {
  ARENA_LIMIT,
  createWasmKernels,
  memory64Limit,
  packSliceRows,
  type WasmKernels,
} from "./wasm.ts";
