import { mkdtemp } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { gguf } from "@huggingface/gguf";
import { describe, expect, it } from "vitest";
import { FAMILIES, familyTokenizerFiles } from "../../test/families.ts";
import { tinyModel } from "../../test/fixtures.ts";
import { exportGguf, GgufTokenizerError, ggufBytes, permuteForGguf, readGguf } from "./gguf.ts";
import { parameterCount } from "./model.ts";
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
