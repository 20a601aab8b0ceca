// The ES lib has no WebAssembly types and @types/node does not declare them; this is the subset used.
declare namespace WebAssembly {
  interface MemoryDescriptor {
    /** Pages; a BigInt when `address` is "i64". */
    initial: number | bigint;
    maximum?: number | bigint;
    shared?: boolean;
    /** "i64": a Memory64 memory, which may grow past 4 GiB. */
    address?: "i32" | "i64";
  }
  class Memory {
    constructor(descriptor: MemoryDescriptor);
    readonly buffer: ArrayBuffer | SharedArrayBuffer;
    grow(delta: number | bigint): number | bigint;
  }
  class Module {
    constructor(bytes: BufferSource);
  }
  class Instance {
    constructor(module: Module, imports?: Record<string, Record<string, unknown>>);
    readonly exports: Record<string, unknown>;
  }
  type BufferSource = ArrayBufferView | ArrayBuffer;
  function validate(bytes: BufferSource): boolean;
}
