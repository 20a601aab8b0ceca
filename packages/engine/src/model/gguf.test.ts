import { mkdtemp, readFile, stat } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { gguf } from "@huggingface/gguf";
import { describe, expect, it } from "vitest";
import { FAMILIES, familyTokenizerFiles } from "../../test/families.ts";
import { tinyModel } from "../../test/fixtures.ts";
import { weightArray } from "../kernels/weight.ts";
import { catalogModelDir } from "./catalog.ts";
import {
  exportGguf,
  GgmlType,
  GgufTokenizerError,
  ggufBytes,
  permuteForGguf,
  quantizeQ8_0,
  readGguf,
} from "./gguf.ts";
import { loadModel, parameterCount } from "./model.ts";
import { ggufPreTokenizer, Tokenizer } from "./tokenizer.ts";

describe("GGUF export", () => {
  const model = tinyModel(12);
  const file = readGguf(ggufBytes(model, "tiny"));

  it("when read back, then the header and llama metadata round-trip", () => {
    expect(file.version).toBe(3);
    const m = file.metadata;
    expect(m.get("general.architecture")).toBe("llama");
    expect(m.get("general.name")).toBe("tiny");
    expect(m.get("llama.block_count")).toBe(2);
    expect(m.get("llama.embedding_length")).toBe(16);
    expect(m.get("llama.attention.head_count")).toBe(2);
    expect(m.get("llama.attention.head_count_kv")).toBe(1);
    expect(m.get("llama.rope.dimension_count")).toBe(8);
    expect(m.get("llama.attention.layer_norm_rms_epsilon")).toBeCloseTo(1e-5, 10);
    expect(m.get("tokenizer.ggml.model")).toBe("gpt2");
    const tokens = m.get("tokenizer.ggml.tokens") as string[];
    expect(tokens).toHaveLength(model.config.vocabSize);
    expect(tokens[model.tokenizer.tokenId("<|im_end|>")!]).toBe("<|im_end|>");
    const types = m.get("tokenizer.ggml.token_type") as number[];
    expect(types[model.tokenizer.tokenId("<|im_end|>")!]).toBe(3);
    expect(types[0]).toBe(1);
    expect((m.get("tokenizer.ggml.merges") as string[])[0]).toBe(model.tokenizer.merges()[0]);
    expect(m.get("tokenizer.ggml.eos_token_id")).toBe(model.config.eosTokenId[0]);
  });

  it("when tensors are read back, then shapes use ggml order and Q/K rows are rope-permuted", () => {
    const names = file.tensors.map((t) => t.name);
    expect(names).toContain("blk.1.ffn_down.weight");
    expect(names).toContain("output.weight");
    const q = file.tensors.find((t) => t.name === "blk.0.attn_q.weight")!;
    expect(q.dims).toEqual([16, 16]);
    expect(file.tensors.find((t) => t.name === "blk.0.attn_k.weight")!.dims).toEqual([16, 8]);
    expect(Array.from(file.tensorData("blk.0.ffn_up.weight"))).toEqual(
      Array.from(model.weights.layers[0]!.up),
    );
    const permuted = file.tensorData("blk.0.attn_q.weight");
    const original = model.weights.layers[0]!.q;
    // Head 1, pair element j=1 of i=2: HF row 8 + 4 + 2 = 14 becomes GGUF row 8 + 2·2 + 1 = 13.
    expect(Array.from(permuted.subarray(13 * 16, 14 * 16))).toEqual(
      Array.from(original.subarray(14 * 16, 15 * 16)),
    );
    expect(Array.from(file.tensorData("blk.0.attn_k.weight"))).toEqual(
      Array.from(permuteForGguf(model.weights.layers[0]!.k, 1, 16)),
    );
    for (const t of file.tensors) expect(t.offset % 32).toBe(0);
  });

  it("when parsed by Hugging Face's independent GGUF reader, then it agrees with ours", async () => {
    const path = join(await mkdtemp(join(tmpdir(), "arbor-gguf-")), "tiny.gguf");
    await exportGguf(model, path, "tiny");
    const parsed = await gguf(path, { allowLocalFile: true, computeParametersCount: true });
    const metadata = parsed.metadata as unknown as Record<string, unknown>;
    expect(metadata["version"]).toBe(3);
    expect(metadata["general.architecture"]).toBe("llama");
    expect(metadata["llama.attention.head_count_kv"]).toBe(1);
    expect(metadata["tokenizer.ggml.model"]).toBe("gpt2");
    expect(parsed.parameterCount).toBe(parameterCount(model));
    expect(Number(parsed.tensorDataOffset)).toBe(file.dataOffset);
    expect(parsed.tensorInfos.map((t) => [t.name, t.shape.map(Number), Number(t.offset)])).toEqual(
      file.tensors.map((t) => [t.name, t.dims, t.offset]),
    );
  });
});

/**
 * ggml's Q8_0 as its format is described, written apart from the export's: per block of 32, an
 * F16 scale d = max|x| / 127 (F32 arithmetic), then each x · (1/d) rounded half away from zero.
 */
function referenceQ8_0(values: Float32Array): Uint8Array {
  const out = new Uint8Array((values.length / 32) * 34);
  const f32 = new Float32Array(3);
  const scale = new Uint8Array(new Float16Array(1).buffer);
  for (let block = 0; block < values.length / 32; block++) {
    const xs = values.subarray(block * 32, block * 32 + 32);
    f32[0] = xs.reduce((m, x) => Math.max(m, Math.abs(x)), 0) / 127; // d
    f32[1] = f32[0] === 0 ? 0 : 1 / f32[0]!; // 1/d
    new Float16Array(scale.buffer)[0] = f32[0]!;
    out.set(scale, block * 34);
    const qs = new Int8Array(out.buffer, block * 34 + 2, 32);
    xs.forEach((x, j) => {
      f32[2] = x * f32[1]!;
      qs[j] = Math.trunc(f32[2]! + (f32[2]! < 0 ? -0.5 : 0.5));
    });
  }
  return out;
}

describe("GGUF export as Q8_0", () => {
  it("when a block is quantized, then it is the F16 scale max|x|/127 and the values rounded half away from zero", () => {
    const block = new Float32Array(32);
    block.set([-127, 2.5, -2.5, 0.5, -0.5, 1.49, 126.6, -0.2]);
    const bytes = quantizeQ8_0(block);
    expect(bytes).toHaveLength(34);
    expect(Array.from(bytes.subarray(0, 2))).toEqual([0x00, 0x3c]); // F16 1.0, little-endian
    expect(Array.from(new Int8Array(bytes.buffer, 2, 8))).toEqual([-127, 3, -3, 1, -1, 1, 127, 0]);
    expect(Array.from(quantizeQ8_0(new Float32Array(32)))).toEqual(new Array(34).fill(0));
    expect(() => quantizeQ8_0(new Float32Array(48))).toThrow(/blocks of 32/);
  });

  it("when a model is exported as q8_0, then its weight matrices are Q8_0 blocks byte for byte, rows not of whole blocks F16, norms F32", () => {
    // ffn_down's rows are 40 long: not whole blocks of 32, so F16 as llama.cpp's converter does.
    const model = tinyModel(5, { hiddenSize: 32, intermediateSize: 40 });
    const bytes = ggufBytes(model, "tiny", "q8_0");
    const file = readGguf(bytes);
    expect(file.metadata.get("general.file_type")).toBe(7);
    const type = (name: string) => file.tensors.find((t) => t.name === name)!.ggmlType;
    expect(type("token_embd.weight")).toBe(GgmlType.Q8_0);
    expect(type("output.weight")).toBe(GgmlType.Q8_0);
    expect(type("blk.0.attn_q.weight")).toBe(GgmlType.Q8_0);
    expect(type("blk.1.ffn_up.weight")).toBe(GgmlType.Q8_0);
    expect(type("blk.1.ffn_down.weight")).toBe(GgmlType.F16);
    expect(type("blk.0.attn_norm.weight")).toBe(GgmlType.F32);
    expect(type("output_norm.weight")).toBe(GgmlType.F32);
    const layer = model.weights.layers[1]!;
    const at = (name: string) =>
      file.dataOffset + file.tensors.find((t) => t.name === name)!.offset;
    const expectBlocks = (name: string, values: Float32Array) => {
      const want = referenceQ8_0(values);
      expect(Buffer.from(bytes.subarray(at(name), at(name) + want.length)).equals(want)).toBe(true);
    };
    expectBlocks("blk.1.ffn_up.weight", layer.up);
    expectBlocks("blk.1.attn_v.weight", layer.v);
    expectBlocks("blk.1.attn_q.weight", permuteForGguf(layer.q, 2, 32));
    expectBlocks("token_embd.weight", weightArray(model.weights.embed));
    // Read back: within half a step of each weight, plus the F16 scale's rounding (≤ 2⁻¹¹·d)
    // times |q| ≤ 127; F16 and F32 as they round.
    const up = file.tensorData("blk.1.ffn_up.weight");
    for (let b = 0; b < layer.up.length / 32; b++) {
      const xs = layer.up.subarray(b * 32, b * 32 + 32);
      const d = Math.max(...xs.map(Math.abs)) / 127;
      for (let j = 0; j < 32; j++)
        expect(Math.abs(up[b * 32 + j]! - xs[j]!)).toBeLessThanOrEqual(d * (0.5 + 127 / 2048));
    }
    expect(Array.from(file.tensorData("blk.1.ffn_down.weight"))).toEqual(
      Array.from(new Float16Array(layer.down)),
    );
    expect(Array.from(file.tensorData("output_norm.weight"))).toEqual(
      Array.from(weightArray(model.weights.norm)),
    );
    for (const t of file.tensors) expect(t.offset % 32).toBe(0);
  });

  it("when the shipped model is exported as q8_0, then its weight matrices take 8.5/32 of their F32 bytes and Hugging Face's reader agrees", async () => {
    const model = await loadModel(catalogModelDir("arbor/tiny-chat"));
    const dir = await mkdtemp(join(tmpdir(), "arbor-gguf-"));
    await exportGguf(model, join(dir, "f32.gguf"), "tiny-chat");
    await exportGguf(model, join(dir, "q8.gguf"), "tiny-chat", "q8_0");
    const f32 = readGguf(await readFile(join(dir, "f32.gguf")));
    const q8Bytes = await readFile(join(dir, "q8.gguf"));
    const q8 = readGguf(q8Bytes);
    const count = (t: { dims: number[] }) => t.dims.reduce((a, b) => a * b, 1);
    const quantized = q8.tensors.filter((t) => t.ggmlType === GgmlType.Q8_0);
    // Every weight matrix of tiny-chat has rows of whole blocks: all of them are Q8_0.
    expect(quantized.map((t) => t.name)).toEqual(
      f32.tensors.filter((t) => t.dims.length === 2).map((t) => t.name),
    );
    const weights = quantized.reduce((n, t) => n + count(t), 0);
    const f32Size = (await stat(join(dir, "f32.gguf"))).size;
    const q8Size = q8Bytes.length;
    // The header is the same length; each matrix shrinks from 4 bytes a weight to 34/32.
    expect(q8.dataOffset).toBe(f32.dataOffset);
    expect(f32Size - q8Size).toBeGreaterThanOrEqual(
      weights * (4 - 34 / 32) - 32 * quantized.length,
    );
    expect(f32Size - q8Size).toBeLessThanOrEqual(weights * (4 - 34 / 32));
    expect(q8Size - q8.dataOffset).toBeLessThan(0.27 * (f32Size - f32.dataOffset));
    const parsed = await gguf(join(dir, "q8.gguf"), { allowLocalFile: true });
    expect(
      parsed.tensorInfos.map((t) => [t.name, t.shape.map(Number), t.dtype, Number(t.offset)]),
    ).toEqual(q8.tensors.map((t) => [t.name, t.dims, t.ggmlType, t.offset]));
  });
});

describe("tokenizer.ggml.pre", () => {
  it.each([
    ["Qwen3", "qwen2"],
    ["Llama 3", "llama-bpe"],
    ["Llama 3.1", "llama-bpe"],
  ] as const)("when the tokenizer is %s's, then llama.cpp's pre-tokenizer is %s", (name, pre) => {
    const family = FAMILIES.find((f) => f.name === name)!;
    expect(ggufPreTokenizer(familyTokenizerFiles(family).tokenizer)).toBe(pre);
  });

  it("when the model is tiny-chat (every digit alone), then it is qwen2's, written in the file", () => {
    expect(readGguf(ggufBytes(tinyModel(12), "tiny")).metadata.get("tokenizer.ggml.pre")).toBe(
      "qwen2",
    );
  });

  it("when the tokenizer splits digits alone before GPT-2's split, then it is SmolLM's", () => {
    const smollm = {
      pre_tokenizer: {
        type: "Sequence",
        pretokenizers: [
          { type: "Digits", individual_digits: true },
          { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: true },
        ],
      },
    };
    expect(ggufPreTokenizer(smollm)).toBe("smollm");
  });

  it("when llama.cpp has no pre-tokenizer that splits alike, then there is none and no GGUF is written", () => {
    const llama3 = familyTokenizerFiles(FAMILIES.find((f) => f.name === "Llama 3")!).tokenizer;
    const changed = structuredClone(llama3) as { pre_tokenizer: { pretokenizers: unknown[] } };
    (changed.pre_tokenizer.pretokenizers[0] as { pattern: { Regex: string } }).pattern.Regex =
      "\\p{N}{1,2}|\\s+";
    expect(ggufPreTokenizer(changed)).toBeUndefined();
    expect(ggufPreTokenizer({ pre_tokenizer: { type: "Metaspace", replacement: "▁" } })).toBe(
      undefined,
    );
    const model = tinyModel(12);
    const { files } = model.tokenizer;
    const pre = structuredClone(files.tokenizer.pre_tokenizer) as {
      pretokenizers: { pattern: { Regex: string } }[];
    };
    pre.pretokenizers[0]!.pattern.Regex = "\\p{N}{1,2}|\\s+|[^\\s\\p{N}]+";
    const tokenizer = new Tokenizer({
      ...files,
      tokenizer: { ...files.tokenizer, pre_tokenizer: pre },
    });
    expect(() => ggufBytes({ ...model, tokenizer }, "tiny")).toThrow(GgufTokenizerError);
  });
});
