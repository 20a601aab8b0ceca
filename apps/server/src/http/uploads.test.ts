import { Readable } from "node:stream";
import { ADAPTER_MAX_BYTES } from "@arbor/training";
import type { Request } from "express";
import { describe, expect, it } from "vitest";
import { multipartBlocks, UPLOAD_BYTES_HELD, UploadBudget, uploadShare } from "./uploads.ts";

describe("UploadBudget", () => {
  it("when shares are taken, then one past the total is refused until another is released", () => {
    const budget = new UploadBudget(100);
    const a = budget.take(60)!;
    expect(budget.take(50)).toBeUndefined();
    const b = budget.take(40)!;
    expect(budget.held).toBe(100);
    a.release();
    a.release();
    expect(budget.held).toBe(40);
    expect(budget.take(60)).toBeDefined();
    b.release();
  });

  it("when a share is larger than the whole budget, then it takes the whole, so an upload alone is always let in", () => {
    const budget = new UploadBudget(100);
    const alone = budget.take(1_000)!;
    expect(budget.held).toBe(100);
    expect(budget.take(1)).toBeUndefined();
    alone.release();
    expect(budget.held).toBe(0);
  });

  it("when a share grows, then it takes more only if that fits, and keeps what it had otherwise", () => {
    const budget = new UploadBudget(100);
    const a = budget.take(10)!;
    const b = budget.take(50)!;
    expect(a.grow(40)).toBe(true);
    expect(budget.held).toBe(90);
    expect(b.grow(70)).toBe(false);
    expect(budget.held).toBe(90);
    a.release();
    b.release();
    expect(budget.held).toBe(0);
  });
});

describe("uploadShare", () => {
  const tar = { "content-type": "application/x-tar" };
  it("when the body's length is known and plain, then the share is that many bytes times what an upload holds of each", () => {
    expect(uploadShare({ ...tar, "content-length": "1000" })).toBe(UPLOAD_BYTES_HELD * 1000);
    expect(
      uploadShare({
        "content-type": "multipart/form-data; boundary=x",
        "content-length": "5000",
      }),
    ).toBe(UPLOAD_BYTES_HELD * 5000);
  });

  it("when the body is gzipped, encoded or of unknown length, then the share is what the cap may unzip to", () => {
    const most = UPLOAD_BYTES_HELD * ADAPTER_MAX_BYTES;
    expect(uploadShare({ "content-type": "application/gzip", "content-length": "10" })).toBe(most);
    expect(uploadShare({ ...tar, "content-length": "10", "content-encoding": "br" })).toBe(most);
    expect(uploadShare({ ...tar, "transfer-encoding": "chunked" })).toBe(most);
  });

  it("when a tar says it is over the cap, then it has no share (413)", () => {
    expect(uploadShare({ ...tar, "content-length": String(ADAPTER_MAX_BYTES + 1) })).toBe(
      undefined,
    );
    // A multipart body is capped per file, not as a whole.
    expect(
      uploadShare({
        "content-type": "multipart/form-data; boundary=x",
        "content-length": String(ADAPTER_MAX_BYTES + 1),
      }),
    ).toBe(UPLOAD_BYTES_HELD * (ADAPTER_MAX_BYTES + 1));
  });
});

describe("multipartBlocks", () => {
  it("when a file arrives in chunks across block boundaries, then its blocks hold its bytes in order", async () => {
    const bytes = Buffer.alloc(9 * 1024 * 1024 + 123);
    for (let i = 0; i < bytes.length; i++) bytes[i] = (i * 31) & 0xff;
    const chunks: Buffer[] = [];
    for (let at = 0; at < bytes.length; at += 100_003)
      chunks.push(bytes.subarray(at, at + 100_003));
    const info = await new Promise<{ parts: Uint8Array[]; size: number }>((resolve, reject) =>
      multipartBlocks._handleFile({} as Request, { stream: Readable.from(chunks) }, (err, got) =>
        err ? reject(err) : resolve(got!),
      ),
    );
    expect(info.size).toBe(bytes.length);
    expect(info.parts.map((p) => p.length)).toEqual([4 << 20, 4 << 20, (1 << 20) + 123]);
    expect(Buffer.concat(info.parts).equals(bytes)).toBe(true);
  });
});
