import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { tinyModel } from "../../test/fixtures.ts";
import { loadModel, saveModel } from "./model.ts";
import {
  readSafetensors,
  SafetensorsError,
  saveSafetensors,
  type TensorMap,
} from "./safetensors.ts";

/** A safetensors file of `header` as written (any JSON text) and `dataBytes` of zeros. */
function withHeader(header: string, dataBytes = 0): Uint8Array {
  const text = new TextEncoder().encode(header);
  const bytes = new Uint8Array(8 + text.length + dataBytes);
  new DataView(bytes.buffer).setBigUint64(0, BigInt(text.length), true);
  bytes.set(text, 8);
  return bytes;
}

/** What `read` throws, as a SafetensorsError. */
function refusal(read: () => unknown): SafetensorsError {
  try {
    read();
  } catch (err) {
    expect(err).toBeInstanceOf(SafetensorsError);
    return err as SafetensorsError;
  }
  throw new Error("no error");
}

describe("safetensors", () => {
  it("when tensors are saved and read, then names, shapes, values and metadata survive", () => {
    const tensors: TensorMap = new Map([
      ["b.weight", { shape: [2, 3], data: Float32Array.from([1, -2, 3.5, 0, 1e-8, -7]) }],
      ["a.bias", { shape: [1], data: Float32Array.from([42]) }],
    ]);
    const bytes = saveSafetensors(tensors, { format: "pt" });
    const headerLength = Number(new DataView(bytes.buffer).getBigUint64(0, true));
    expect((8 + headerLength) % 8).toBe(0);
    const { tensors: back, metadata } = readSafetensors(bytes);
    expect(metadata).toEqual({ format: "pt" });
    expect(back.get("b.weight")?.shape).toEqual([2, 3]);
    expect(Array.from(back.get("b.weight")!.data)).toEqual(
      Array.from(tensors.get("b.weight")!.data),
    );
    expect(Array.from(back.get("a.bias")!.data)).toEqual([42]);
  });

  it("when a BF16 tensor is read, then it widens to f32", () => {
    const header = JSON.stringify({ x: { dtype: "BF16", shape: [2], data_offsets: [0, 4] } });
    const bytes = new Uint8Array(8 + header.length + 4);
    const view = new DataView(bytes.buffer);
    view.setBigUint64(0, BigInt(header.length), true);
    bytes.set(new TextEncoder().encode(header), 8);
    view.setUint16(8 + header.length, 0x3f80, true); // 1.0
    view.setUint16(8 + header.length + 2, 0xc000, true); // -2.0
    expect(Array.from(readSafetensors(bytes).tensors.get("x")!.data)).toEqual([1, -2]);
  });

  it("when a model folder is saved and loaded, then config, tokenizer and weights match", async () => {
    const model = tinyModel(2);
    const dir = await mkdtemp(join(tmpdir(), "arbor-engine-"));
    await saveModel(model, dir);
    const loaded = await loadModel(dir);
    expect(loaded.config).toEqual(model.config);
    expect(Array.from(loaded.weights.layers[1]!.down)).toEqual(
      Array.from(model.weights.layers[1]!.down),
    );
    expect(Array.from(loaded.weights.lmHead!)).toEqual(Array.from(model.weights.lmHead!));
    expect(loaded.tokenizer.encode("The cat", { special: true })).toEqual(
      model.tokenizer.encode("The cat", { special: true }),
    );
  });

  it("when weights are sharded with an index, then the model loads from the shards", async () => {
    const model = tinyModel(2);
    const dir = await mkdtemp(join(tmpdir(), "arbor-engine-"));
    await saveModel(model, dir);
    const { tensors } = readSafetensors(await readFile(join(dir, "model.safetensors")));
    const names = [...tensors.keys()];
    const half = Math.floor(names.length / 2);
    const shard = (part: string[]) => new Map(part.map((n) => [n, tensors.get(n)!]));
    await writeFile(join(dir, "a.safetensors"), saveSafetensors(shard(names.slice(0, half))));
    await writeFile(join(dir, "b.safetensors"), saveSafetensors(shard(names.slice(half))));
    const weightMap = Object.fromEntries(
      names.map((n, i) => [n, i < half ? "a.safetensors" : "b.safetensors"]),
    );
    await writeFile(
      join(dir, "model.safetensors.index.json"),
      JSON.stringify({ weight_map: weightMap }),
    );
    await rm(join(dir, "model.safetensors"));
    const loaded = await loadModel(dir);
    expect(Array.from(loaded.weights.norm)).toEqual(Array.from(model.weights.norm));
    expect(Array.from(loaded.weights.layers[1]!.q)).toEqual(Array.from(model.weights.layers[1]!.q));
  });

  it("when a header is larger than allowed, then it is refused from its length alone, before any of it is read", () => {
    // Declares a gigabyte of header: the file is cut off, but the length is refused first.
    const bytes = new Uint8Array(16);
    new DataView(bytes.buffer).setBigUint64(0, BigInt(1 << 30), true);
    expect(refusal(() => readSafetensors(bytes)).message).toBe(
      "safetensors: the header is 1073741824 bytes, more than the 104857600 allowed",
    );
    const small = withHeader(
      JSON.stringify({ x: { dtype: "F32", shape: [1], data_offsets: [0, 4] } }),
      4,
    );
    expect(refusal(() => readSafetensors(small, { maxHeaderBytes: 16 })).message).toMatch(
      /more than the 16 allowed/,
    );
  });

  it("when a header lists more tensors than allowed, then it is refused at the first one past the limit, before the rest is parsed", () => {
    const entry = (i: number) => `"t${i}":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}`;
    const three = `{"__metadata__":{"format":"pt"},${[0, 1, 2].map(entry).join(",")}}`;
    expect(readSafetensors(withHeader(three, 4), { maxTensors: 3 }).tensors.size).toBe(3);
    // What follows the fourth entry is not even JSON: the count stops the reader first.
    const four = `{${[0, 1, 2, 3].map(entry).join(",")}, this is not JSON`;
    expect(refusal(() => readSafetensors(withHeader(four, 4), { maxTensors: 3 })).message).toBe(
      "safetensors: the header lists more than 3 tensors",
    );
  });

  it("when a header names a key twice, at its top or inside an entry, written alike or escaped, then it is refused naming the key", () => {
    const entry = `{"dtype":"F32","shape":[1],"data_offsets":[0,4]}`;
    const twice = refusal(() =>
      readSafetensors(withHeader(`{"a.b":${entry},"c":${entry},"a.b":${entry}}`, 4)),
    );
    expect(twice.message).toBe("safetensors: the header names a.b twice");
    expect(twice.tensor).toBe("a.b");
    expect(
      refusal(() => readSafetensors(withHeader(`{"ab":${entry},"a\\u0062":${entry}}`, 4))).tensor,
    ).toBe("ab");
    const inner = `{"x":{"dtype":"F32","shape":[1],"dtype":"BF16","data_offsets":[0,4]}}`;
    expect(refusal(() => readSafetensors(withHeader(inner, 4))).tensor).toBe("dtype");
    // A key's text inside a string value, or the same key in two entries, is no repeat.
    const fine = `{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"y":${entry},"__metadata__":{"note":"\\"x\\":"}}`;
    expect([...readSafetensors(withHeader(fine, 4)).tensors.keys()]).toEqual(["x", "y"]);
  });

  it("when a shape holds a negative or fractional size, then the entry is refused naming it", () => {
    const header = JSON.stringify({ w: { dtype: "F32", shape: [-1, -1], data_offsets: [0, 4] } });
    expect(refusal(() => readSafetensors(withHeader(header, 4))).tensor).toBe("w");
  });
});
