import type { BaseModelFolder } from "@arbor/engine/model";
import { InvalidInputError } from "@arbor/store";
import { describe, expect, it } from "vitest";
import {
  keyOf,
  parseFutureId,
  parseSamplerId,
  parseTinkerPath,
  sampleRequest,
  samplerId,
  servedBase,
  targetsOf,
} from "./routes.ts";

const base = (id: string, parameters: number) => ({ id, parameters }) as BaseModelFolder;

describe("Tinker's names (ADR 71)", () => {
  it("when a Hub name of a tokenizer family is asked, then the smallest served base of that family answers; a served name is itself; others none", () => {
    const bases = [
      base("arbor/tiny-chat", 1),
      base("Qwen/Qwen3-1.7B", 1700),
      base("Qwen/Qwen3-0.6B", 600),
      base("meta-llama/Llama-3.2-1B-Instruct", 1000),
    ];
    expect(servedBase("Qwen/Qwen3-8B", bases)?.id).toBe("Qwen/Qwen3-0.6B");
    expect(servedBase("Qwen/Qwen3-1.7B", bases)?.id).toBe("Qwen/Qwen3-1.7B");
    expect(servedBase("meta-llama/Llama-3.1-8B", bases)?.id).toBe(
      "meta-llama/Llama-3.2-1B-Instruct",
    );
    expect(servedBase("arbor/tiny-chat", bases)?.id).toBe("arbor/tiny-chat");
    expect(servedBase("Qwen/Qwen2.5-7B", bases)).toBeUndefined();
    expect(servedBase("Qwen/Qwen3-8B", [base("arbor/tiny-chat", 1)])).toBeUndefined();
    // A served base added under another case (the README's `--id qwen/Qwen3-0.6B`) is found.
    expect(servedBase("Qwen/Qwen3-8B", [base("qwen/Qwen3-0.6B", 600)])?.id).toBe("qwen/Qwen3-0.6B");
  });

  it("when lora_config's switches are read, then they name PEFT's targets, all by default", () => {
    expect(targetsOf({})).toEqual([
      "down_proj",
      "gate_proj",
      "k_proj",
      "lm_head",
      "o_proj",
      "q_proj",
      "up_proj",
      "v_proj",
    ]);
    expect(targetsOf({ train_mlp: false, train_unembed: false })).toEqual([
      "k_proj",
      "o_proj",
      "q_proj",
      "v_proj",
    ]);
    expect(targetsOf({ train_attn: false, train_mlp: false, train_unembed: false })).toEqual([]);
  });

  it("when ids and paths are read back, then each round-trips and anything else is refused", () => {
    expect(keyOf("tml-abc")).toBe("abc");
    expect(keyOf(" abc ")).toBe("abc");
    expect(keyOf(undefined)).toBeNull();
    expect(parseTinkerPath("tinker://r1/weights/a")).toEqual({
      runId: "r1",
      kind: "weights",
      name: "a",
    });
    expect(parseTinkerPath("tinker://r1/sampler_weights/a/b")).toBeNull();
    expect(parseTinkerPath("tinker://r1/other/a")).toBeNull();
    expect(parseFutureId("op.r.o")).toEqual({
      kind: "op",
      runId: "r",
      opId: "o",
      ephemeral: false,
    });
    expect(parseFutureId("op.r.o.e")).toEqual({
      kind: "op",
      runId: "r",
      opId: "o",
      ephemeral: true,
    });
    expect(parseFutureId("model.r")).toEqual({ kind: "model", runId: "r" });
    expect(parseFutureId("op.r")).toBeNull();
    for (const s of [
      { kind: "base", baseId: "Qwen/Qwen3-0.6B" },
      { kind: "checkpoint", runId: "r", step: 3 },
    ] as const)
      expect(parseSamplerId(samplerId(s))).toEqual(s);
    expect(parseSamplerId("sampler.r.x")).toBeNull();
  });

  it("when an asample body is read, then stops split into strings and ids, top_k -1 is off, and bad values are 400", () => {
    const ok = sampleRequest({
      num_samples: 2,
      prompt: { chunks: [{ tokens: [1, 2], type: "encoded_text" }, { tokens: [3] }] },
      sampling_params: { max_tokens: 4, stop: ["\n\nUser:", 7], top_k: -1, seed: 5 },
      prompt_logprobs: true,
    });
    expect(ok).toMatchObject({
      prompt: [1, 2, 3],
      n: 2,
      maxTokens: 4,
      topK: 0,
      seed: 5,
      stopStrings: ["\n\nUser:"],
      stopTokens: [7],
      promptLogprobs: true,
    });
    expect(
      sampleRequest({ prompt: { chunks: [{ tokens: [1] }] }, sampling_params: { stop: "x" } }),
    ).toMatchObject({ stopStrings: ["x"], stopTokens: [], n: 1, temperature: 1 });
    const refused = [
      { prompt: { chunks: [] } },
      { prompt: { chunks: [{ tokens: [1], type: "image" }] } },
      { prompt: { chunks: [{ tokens: [1] }] }, num_samples: 0 },
      { prompt: { chunks: [{ tokens: [1] }] }, topk_prompt_logprobs: 3 },
      { prompt: { chunks: [{ tokens: [1] }] }, sampling_params: { stop: [1.5] } },
      { prompt: { chunks: [{ tokens: [1] }] }, sampling_params: { temperature: -1 } },
    ];
    for (const body of refused) expect(() => sampleRequest(body)).toThrow(InvalidInputError);
  });
});
