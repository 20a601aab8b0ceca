/** Bytes in a WebAssembly page. */
export const PAGE = 65536;
/** wasm32's whole address space in pages: 4 GiB. */
export const MAX_PAGES = 65536;
/**
 * The most pages of a Memory64 arena: 16 GiB, V8's limit for a 64-bit memory (the memory64
 * kernels declare this maximum).
 */
export const MAX_PAGES_64 = 262144;

/**
 * First-fit allocation of byte ranges in the kernels' WebAssembly.Memory: packed weights, KV
 * cache mirrors and workspaces. Freed ranges are kept sorted and merged; everything above `top`
 * is free, and one kernel call's scratch space starts there.
 */
export class ArenaAllocator {
  /** End of the highest block in use. */
  top: number;
  private readonly holes: { offset: number; size: number }[] = [];

  private readonly base: number;

  constructor(base: number) {
    this.base = base;
    this.top = base;
  }

  alloc(bytes: number): number {
    const size = align(bytes);
    for (let i = 0; i < this.holes.length; i++) {
      const hole = this.holes[i]!;
      if (hole.size < size) continue;
      const offset = hole.offset;
      hole.offset += size;
      hole.size -= size;
      if (hole.size === 0) this.holes.splice(i, 1);
      return offset;
    }
    const offset = this.top;
    this.top += size;
    return offset;
  }

  free(offset: number, bytes: number): void {
    let size = align(bytes);
    let start = offset;
    let i = 0;
    while (i < this.holes.length && this.holes[i]!.offset < start) i++;
    const before = this.holes[i - 1];
    if (before && before.offset + before.size === start) {
      start = before.offset;
      size += before.size;
      this.holes.splice(--i, 1);
    }
    const after = this.holes[i];
    if (after && start + size === after.offset) {
      size += after.size;
      this.holes.splice(i, 1);
    }
    if (start + size === this.top) this.top = start;
    else this.holes.splice(i, 0, { offset: start, size });
  }

  /** Bytes in use below `top` (for tests and diagnostics). */
  get used(): number {
    return this.top - this.base - this.holes.reduce((n, h) => n + h.size, 0);
  }
}

export function align(bytes: number): number {
  return Math.ceil(bytes / 64) * 64;
}
