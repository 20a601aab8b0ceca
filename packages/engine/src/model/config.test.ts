import { describe, expect, it } from "vitest";
import { configToJson, parseConfig } from "./config.ts";

describe("parseConfig", () => {
  it("when a minimal Llama config.json is read, then HF defaults apply", () => {
    const config = parseConfig({
      hidden_size: 256,
      intermediate_size: 688,
      num_hidden_layers: 2,
      num_attention_heads: 4,
      vocab_size: 1000,
      eos_token_id: 2,
      bos_token_id: 1,
    });
    expect(config.numKvHeads).toBe(4);
    expect(config.headDim).toBe(64);
    expect(config.eosTokenId).toEqual([2]);
    expect(config.tieWordEmbeddings).toBe(false);
    expect(config.ropeTheta).toBe(10000);
  });

  it("when written and re-read, then the config is unchanged", () => {
    const config = parseConfig({
      hidden_size: 128,
      intermediate_size: 352,
      num_hidden_layers: 4,
      num_attention_heads: 2,
      num_key_value_heads: 1,
      head_dim: 64,
      vocab_size: 768,
      max_position_embeddings: 256,
      rms_norm_eps: 1e-5,
      rope_theta: 10000,
      tie_word_embeddings: true,
      eos_token_id: [766, 765],
    });
    expect(parseConfig(configToJson(config))).toEqual(config);
  });

  it("when heads do not divide into KV groups, then it refuses the config", () => {
    expect(() =>
      parseConfig({
        hidden_size: 96,
        intermediate_size: 1,
        num_hidden_layers: 1,
        num_attention_heads: 3,
        num_key_value_heads: 2,
        vocab_size: 9,
      }),
    ).toThrow("multiple");
  });

  it("when a config needs what the engine does not compute, then it is refused by name", () => {
    const base = {
      hidden_size: 64,
      intermediate_size: 8,
      num_hidden_layers: 1,
      num_attention_heads: 1,
      vocab_size: 9,
    };
    expect(() => parseConfig({ ...base, model_type: "mistral" })).toThrow(
      'model_type "mistral" is not supported (supported: llama, qwen2, qwen3, smollm3)',
    );
    expect(() => parseConfig({ ...base, rope_scaling: { rope_type: "yarn", factor: 4 } })).toThrow(
      "rope_scaling yarn",
    );
    expect(() =>
      parseConfig({ ...base, rope_scaling: { rope_type: "llama3", factor: 8 } }),
    ).toThrow("low_freq_factor");
    expect(() => parseConfig({ ...base, use_sliding_window: true })).toThrow("sliding-window");
    expect(() => parseConfig({ ...base, mlp_bias: true })).toThrow("mlp_bias");
    expect(() => parseConfig({ ...base, hidden_act: "gelu" })).toThrow("gelu");
    expect(parseConfig({ ...base, rope_scaling: null }).hiddenSize).toBe(64);
  });

  it("when each family's config is read, then its differences are known, and written back unchanged", () => {
    const common = {
      hidden_size: 64,
      intermediate_size: 96,
      num_hidden_layers: 4,
      num_attention_heads: 4,
      num_key_value_heads: 2,
      vocab_size: 100,
    };
    const llama = parseConfig({
      ...common,
      model_type: "llama",
      rope_scaling: {
        rope_type: "llama3",
        factor: 32,
        low_freq_factor: 1,
        high_freq_factor: 4,
        original_max_position_embeddings: 8192,
      },
    });
    expect(llama.ropeScaling).toEqual({
      factor: 32,
      lowFreqFactor: 1,
      highFreqFactor: 4,
      originalMaxPositions: 8192,
    });
    const qwen2 = parseConfig({ ...common, model_type: "qwen2" });
    expect([qwen2.qkvBias, qwen2.oBias, qwen2.qkNorm]).toEqual([true, false, false]);
    const qwen3 = parseConfig({ ...common, model_type: "qwen3", head_dim: 32 });
    expect([qwen3.qkvBias, qwen3.qkNorm, qwen3.headDim]).toEqual([false, true, 32]);
    const smol = parseConfig({ ...common, model_type: "smollm3" });
    expect(smol.ropeLayers).toEqual([true, true, true, false]);
    for (const config of [llama, qwen2, qwen3, smol]) {
      expect(parseConfig(configToJson(config))).toEqual(config);
    }
  });
});
