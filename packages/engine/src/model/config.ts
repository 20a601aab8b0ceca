/** The architectures the engine computes, by `config.json`'s `model_type`. */
export const MODEL_TYPES = ["llama", "qwen2", "qwen3", "smollm3"] as const;
export type ModelType = (typeof MODEL_TYPES)[number];

/** Llama 3.1's RoPE frequency scaling (`rope_scaling.rope_type: "llama3"`). */
export interface Llama3RopeScaling {
  factor: number;
  lowFreqFactor: number;
  highFreqFactor: number;
  originalMaxPositions: number;
}

/** What the engine uses of a Hugging Face `config.json`: a decoder of the Llama family. */
export interface ModelConfig {
  /** `llama` (Llama 3.x, SmolLM2), `qwen2` (biased q/k/v), `qwen3` (per-head q/k RMSNorm),
   * `smollm3` (Llama with NoPE layers). */
  modelType: ModelType;
  hiddenSize: number;
  intermediateSize: number;
  numLayers: number;
  numHeads: number;
  numKvHeads: number;
  /** Independent of hidden / heads (Qwen3). */
  headDim: number;
  vocabSize: number;
  /** The context the engine serves: the model's `max_position_embeddings`. */
  maxPositions: number;
  rmsNormEps: number;
  ropeTheta: number;
  ropeScaling: Llama3RopeScaling | null;
  /** Per layer, whether it rotates q and k (SmolLM3's NoPE layers do not); null: all do. */
  ropeLayers: boolean[] | null;
  /** Biases on the q, k and v projections (Qwen2, Llama's `attention_bias`). */
  qkvBias: boolean;
  /** A bias on the output projection (Llama's `attention_bias`). */
  oBias: boolean;
  /** RMSNorm over each head of q and k before RoPE (Qwen3). */
  qkNorm: boolean;
  tieWordEmbeddings: boolean;
  bosTokenId: number | null;
  eosTokenId: number[];
}

/** Reads `config.json`, refusing by name what the engine would otherwise compute wrongly. */
export function parseConfig(json: Record<string, unknown>): ModelConfig {
  const refuse = (why: string): never => {
    throw new Error(`config.json: ${why}`);
  };
  const num = (key: string, fallback?: number): number => {
    const value = json[key];
    if (typeof value === "number" && Number.isFinite(value)) return value;
    if (fallback !== undefined) return fallback;
    return refuse(`missing number ${key}`);
  };
  const modelType = json.model_type ?? "llama";
  if (typeof modelType !== "string" || !(MODEL_TYPES as readonly string[]).includes(modelType)) {
    refuse(
      `model_type ${JSON.stringify(modelType)} is not supported (supported: ${MODEL_TYPES.join(", ")})`,
    );
  }
  const type = modelType as ModelType;
  const hiddenSize = num("hidden_size");
  const numHeads = num("num_attention_heads");
  const numLayers = num("num_hidden_layers");
  const eos = json.eos_token_id;
  // transformers 5 moved rope_theta and rope_scaling into rope_parameters.
  const rope = (json.rope_parameters ?? null) as Record<string, unknown> | null;
  const scaling = (json.rope_scaling ?? rope) as Record<string, unknown> | null;
  const ropeTheta =
    typeof rope?.rope_theta === "number" ? rope.rope_theta : num("rope_theta", 10000);
  const config: ModelConfig = {
    modelType: type,
    hiddenSize,
    intermediateSize: num("intermediate_size"),
    numLayers,
    numHeads,
    numKvHeads: num("num_key_value_heads", numHeads),
    headDim: num("head_dim", hiddenSize / numHeads),
    vocabSize: num("vocab_size"),
    maxPositions: num("max_position_embeddings", 2048),
    rmsNormEps: num("rms_norm_eps", 1e-6),
    ropeTheta,
    ropeScaling: parseRopeScaling(scaling, refuse),
    ropeLayers: null,
    qkvBias: type === "qwen2" || json.attention_bias === true,
    oBias: type !== "qwen2" && json.attention_bias === true,
    qkNorm: type === "qwen3",
    tieWordEmbeddings: json.tie_word_embeddings === true,
    bosTokenId: typeof json.bos_token_id === "number" ? json.bos_token_id : null,
    eosTokenId: Array.isArray(eos)
      ? eos.filter((x): x is number => typeof x === "number")
      : typeof eos === "number"
        ? [eos]
        : [],
  };
  if (type === "smollm3") {
    const listed = json.no_rope_layers;
    const interval = num("no_rope_layer_interval", 4);
    config.ropeLayers = Array.from({ length: numLayers }, (_, l) =>
      Array.isArray(listed) ? listed[l] === 1 : (l + 1) % interval !== 0,
    );
  }
  if (json.use_sliding_window === true) refuse("sliding-window attention is not supported");
  const layerTypes = json.layer_types;
  if (Array.isArray(layerTypes) && layerTypes.some((t) => t !== "full_attention")) {
    refuse("sliding-window attention layers are not supported");
  }
  if (json.mlp_bias === true) refuse("biased MLP projections (mlp_bias) are not supported");
  const act = json.hidden_act;
  if (act !== undefined && act !== "silu") refuse(`hidden_act ${String(act)} is not supported`);
  if (!Number.isInteger(config.headDim) || config.headDim % 2 !== 0) {
    refuse(`head_dim ${config.headDim} must be an even integer`);
  }
  if (config.numHeads % config.numKvHeads !== 0) {
    refuse("num_attention_heads must be a multiple of num_key_value_heads");
  }
  return config;
}

function parseRopeScaling(
  scaling: Record<string, unknown> | null,
  refuse: (why: string) => never,
): Llama3RopeScaling | null {
  const type = scaling?.rope_type ?? scaling?.type ?? "default";
  if (!scaling || type === "default") return null;
  if (type !== "llama3") return refuse(`rope_scaling ${String(type)} is not supported`);
  const field = (key: string): number => {
    const value = scaling[key];
    return typeof value === "number" && value > 0
      ? value
      : refuse(`rope_scaling llama3 needs a positive ${key}`);
  };
  return {
    factor: field("factor"),
    lowFreqFactor: field("low_freq_factor"),
    highFreqFactor: field("high_freq_factor"),
    originalMaxPositions: field("original_max_position_embeddings"),
  };
}

const ARCHITECTURES: Record<ModelType, string> = {
  llama: "LlamaForCausalLM",
  qwen2: "Qwen2ForCausalLM",
  qwen3: "Qwen3ForCausalLM",
  smollm3: "SmolLM3ForCausalLM",
};

/** `config.json` as transformers writes it for the family. */
export function configToJson(config: ModelConfig): Record<string, unknown> {
  const out: Record<string, unknown> = {
    architectures: [ARCHITECTURES[config.modelType]],
    model_type: config.modelType,
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
    rope_scaling: config.ropeScaling
      ? {
          rope_type: "llama3",
          factor: config.ropeScaling.factor,
          low_freq_factor: config.ropeScaling.lowFreqFactor,
          high_freq_factor: config.ropeScaling.highFreqFactor,
          original_max_position_embeddings: config.ropeScaling.originalMaxPositions,
        }
      : null,
    tie_word_embeddings: config.tieWordEmbeddings,
    bos_token_id: config.bosTokenId,
    eos_token_id: config.eosTokenId.length === 1 ? config.eosTokenId[0] : config.eosTokenId,
    hidden_act: "silu",
    mlp_bias: false,
    torch_dtype: "float32",
  };
  if (config.modelType !== "qwen2") out.attention_bias = config.qkvBias;
  if (config.ropeLayers) out.no_rope_layers = config.ropeLayers.map((r) => (r ? 1 : 0));
  return out;
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
