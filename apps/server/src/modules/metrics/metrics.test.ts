import { pino } from "pino";
import { describe, expect, it } from "vitest";
import { MAX_ENTITY_MODEL_LABELS, Metrics, OTHER_MODELS } from "./metrics.ts";

const metrics = () =>
  new Metrics({
    jobCounts: async () => ({ queued: 0, running: 0, succeeded: 0, failed: 0, cancelled: 0 }),
    runOperationCounts: async () => ({ admitted: 0, running: 0 }),
    logger: pino({ level: "silent" }),
  });

describe("Metrics: the model label", () => {
  it("when base and trained models are labelled, then a base model is its id, a trained one its entity's, and entities past the cap are other", () => {
    const m = metrics();
    expect(m.modelLabel({ id: "arbor/tiny-chat", entity: null })).toBe("arbor/tiny-chat");
    for (let i = 0; i < MAX_ENTITY_MODEL_LABELS; i++)
      expect(m.modelLabel({ id: `e${i}/p/secret-${i}:step3`, entity: `e${i}` })).toBe(`e${i}/*`);
    expect(m.modelLabel({ id: "late/p/secret:step1", entity: "late" })).toBe(OTHER_MODELS);
    // An entity labelled before the cap keeps its label; base models are never capped.
    expect(m.modelLabel({ id: "e0/p/another:step9", entity: "e0" })).toBe("e0/*");
    expect(m.modelLabel({ id: "Qwen/Qwen3-0.6B", entity: null })).toBe("Qwen/Qwen3-0.6B");
  });

  it("when 300 trained models of 300 entities each chat once, then the series stay bounded and name no model", async () => {
    const m = metrics();
    const series = async () =>
      (await m.registry.metrics()).split("\n").filter((l) => l.startsWith("arbor_chat_")).length;
    const chat = (id: string, entity: string | null) => {
      const model = { id, entity };
      m.chat.firstToken(model, 0.01);
      m.chat.ended({
        model,
        backend: "engine",
        promptTokens: 3,
        completionTokens: 1,
        generationSeconds: 0.01,
      });
    };
    chat("arbor/tiny-chat", null);
    const one = await series();
    for (let i = 0; i < 300; i++) chat(`tenant${i}/stealth/model-${i}:step1`, `tenant${i}`);
    const text = await m.registry.metrics();
    expect(text).not.toContain("stealth");
    // The base model's series, and as many again for each of the capped labels and `other`.
    expect(await series()).toBe(one * (MAX_ENTITY_MODEL_LABELS + 2));
  });
});
