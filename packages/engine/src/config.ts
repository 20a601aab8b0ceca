/** The subset of a Hugging Face LlamaForCausalLM config.json the engine uses. */
export interface ModelConfig {
  hiddenSize: number;
  intermediateSize: number;
  numLayers: number;
  numHeads: number;
  numKvHeads: number;
  headDim: number;
  vocabSize: number;
  maxPositions: number;
  rmsNormEps: number;
  ropeTheta: number;
  tieWordEmbeddings: boolean;
  bosTokenId: number | null;
  eosTokenId: number[];
}

export function parseConfig(json: Record<string, unknown>): ModelConfig {
  const num = (key: string, fallback?: number): number => {
    const value = json[key];
    if (typeof value === "number") return value;
    if (fallback !== undefined) return fallback;
    throw new Error(`config.json: missing number ${key}`);
  };
  const hiddenSize = num("hidden_size");
  const numHeads = num("num_attention_heads");
  const eos = json["eos_token_id"];
  const config: ModelConfig = {
    hiddenSize,
    intermediateSize: num("intermediate_size"),
    numLayers: num("num_hidden_layers"),
    numHeads,
    numKvHeads: num("num_key_value_heads", numHeads),
    headDim: num("head_dim", hiddenSize / numHeads),
    vocabSize: num("vocab_size"),
    maxPositions: num("max_position_embeddings", 2048),
    rmsNormEps: num("rms_norm_eps", 1e-6),
    ropeTheta: num("rope_theta", 10000),
    tieWordEmbeddings: json["tie_word_embeddings"] === true,
    bosTokenId: typeof json["bos_token_id"] === "number" ? json["bos_token_id"] : null,
    eosTokenId: Array.isArray(eos)
      ? eos.filter((x): x is number => typeof x === "number")
      : typeof eos === "number"
        ? [eos]
        : [],
  };
  // Refuse what the engine would otherwise silently compute wrongly.
  const scaling = json["rope_scaling"] as { rope_type?: string; type?: string } | null | undefined;
  const scalingType = scaling?.rope_type ?? scaling?.type ?? "default";
  if (scaling && scalingType !== "default") {
    throw new Error(`config.json: rope_scaling ${scalingType} is not supported`);
  }
  if (json["attention_bias"] === true || json["mlp_bias"] === true) {
    throw new Error("config.json: biased attention/MLP projections are not supported");
  }
  const act = json["hidden_act"];
  if (act !== undefined && act !== "silu")
    throw new Error(`config.json: hidden_act ${String(act)} is not supported`);
  if (config.numHeads % config.numKvHeads !== 0) {
    throw new Error("config.json: num_attention_heads must be a multiple of num_key_value_heads");
  }
  return config;
}

export function configToJson(config: ModelConfig): Record<string, unknown> {
  return {
    architectures: ["LlamaForCausalLM"],
    model_type: "llama",
    hidden_size: config.hiddenSize,
    intermediate_size: config.intermediateSize,
    num_hidden_layers: config.numLayers,
    num_attention_heads: config.numHeads,
    num_key_value_heads: config.numKvHeads,
    head_dim: config.headDim,
    vocab_size: config.vocabSize,
    max_position_embeddings: config.maxPositions,
    rms_norm_eps: config.rmsNormEps,
    rope_theta: config.ropeTheta,
    tie_word_embeddings: config.tieWordEmbeddings,
    bos_token_id: config.bosTokenId,
    eos_token_id: config.eosTokenId.length === 1 ? config.eosTokenId[0] : config.eosTokenId,
    hidden_act: "silu",
    attention_bias: false,
    mlp_bias: false,
    torch_dtype: "float32",
  };
}

/** `generation_config.json`: the ids that end the text, and sampling defaults that apply when a
 * request leaves a field out. */
export interface GenerationConfig {
  eosTokenId: number[];
  /** 0 when the model's config says `do_sample: false` (greedy). */
  temperature?: number;
  topP?: number;
  topK?: number;
  minP?: number;
  repetitionPenalty?: number;
  /** The file as read, written back by `saveModel`. */
  raw: Record<string, unknown>;
}

export function parseGenerationConfig(json: Record<string, unknown>): GenerationConfig {
  const num = (key: string): number | undefined => {
    const value = json[key];
    return typeof value === "number" && Number.isFinite(value) ? value : undefined;
  };
  const eos = json["eos_token_id"];
  const out: GenerationConfig = {
    eosTokenId: Array.isArray(eos)
      ? eos.filter((x): x is number => typeof x === "number")
      : typeof eos === "number"
        ? [eos]
        : [],
    raw: json,
  };
  const temperature = json["do_sample"] === false ? 0 : num("temperature");
  if (temperature !== undefined) out.temperature = temperature;
  const topP = num("top_p");
  if (topP !== undefined) out.topP = topP;
  const topK = num("top_k");
  if (topK !== undefined) out.topK = topK;
  const minP = num("min_p");
  if (minP !== undefined) out.minP = minP;
  const penalty = num("repetition_penalty");
  if (penalty !== undefined) out.repetitionPenalty = penalty;
  return out;
}
