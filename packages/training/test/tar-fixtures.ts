/** Adapter uploads that test the bounds of reading them: shared by this package's tests and the
 * contract tests (`@arbor/training/test/tar-fixtures`). */
import { gzipSync } from "node:zlib";
import tar from "tar-stream";

/** A ustar header of one entry of `size` bytes, as a tar writer puts it before the data. */
export async function entryHeader(name: string, size: number): Promise<Buffer> {
  const pack = tar.pack();
  const chunks: Buffer[] = [];
  pack.on("data", (c: unknown) => chunks.push(c as Buffer));
  pack.entry({ name, size });
  await new Promise((resolve) => setImmediate(resolve));
  return Buffer.concat(chunks).subarray(0, 512);
}

/** `header`, then `total` bytes of zeros, gzipped (one gzip member per 64 MiB). */
export function gzipBomb(header: Buffer, total: number): Buffer {
  const block = 64 * 1024 * 1024;
  const zeros = gzipSync(Buffer.alloc(block), { level: 9 });
  return Buffer.concat([gzipSync(header), ...Array.from({ length: total / block }, () => zeros)]);
}
