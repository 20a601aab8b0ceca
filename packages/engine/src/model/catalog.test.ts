import { describe, expect, it } from "vitest";
import { Engine } from "../serve/engine.ts";
import { catalogModelDir, listCatalog } from "./catalog.ts";
import { loadModel, parameterCount } from "./model.ts";

describe("shipped catalogue", () => {
  it("when listed, then arbor/tiny-chat is described with its real size and context", async () => {
    const [entry] = listCatalog();
    expect(entry?.id).toBe("arbor/tiny-chat");
    const model = await loadModel(catalogModelDir("arbor/tiny-chat"));
    expect(entry?.parameters).toBe(parameterCount(model));
    expect(entry?.contextLength).toBe(model.config.maxPositions);
    expect(model.config.headDim).toBeGreaterThanOrEqual(64);
    expect(model.config.numKvHeads).toBeLessThan(model.config.numHeads);
    expect(() => catalogModelDir("nope/missing")).toThrow("no shipped model");
  });

  it("when tiny-chat is asked in-domain questions, then it answers fluently and greedily", async () => {
    const engine = new Engine(await loadModel(catalogModelDir("arbor/tiny-chat")));
    const ask = async (content: string) =>
      (
        await engine.complete({
          messages: [{ role: "user", content }],
          temperature: 0,
          maxTokens: 24,
        })
      ).choices[0]!;
    const math = await ask("What is 7 + 5?");
    expect(math.text).toBe("7 + 5 = 12.");
    expect(math.finishReason).toBe("stop");
    expect((await ask("Hello!")).text).toBe("Hello! How can I help you today?");
    expect((await ask("Spell cat.")).text).toBe("c-a-t");
    expect((await ask("Is a cow an animal?")).text).toBe("Yes, a cow is an animal.");
    // Held out of pretraining: word reversal is not solved by the base model.
    expect((await ask("Reverse the word cat.")).text).not.toBe("tac");
  });
  it("when tiny-chat must answer in a JSON schema, then the reply parses and validates", async () => {
    const engine = new Engine(await loadModel(catalogModelDir("arbor/tiny-chat")));
    const result = await engine.complete({
      messages: [{ role: "user", content: "What is 3 + 4? Answer in JSON." }],
      temperature: 0.8,
      seed: 1,
      n: 3,
      maxTokens: 40,
      responseFormat: {
        type: "json_schema",
        schema: {
          type: "object",
          properties: { answer: { type: "integer" } },
          required: ["answer"],
        },
      },
    });
    for (const choice of result.choices) {
      const value = JSON.parse(choice.text) as { answer: unknown };
      expect(Object.keys(value)).toEqual(["answer"]);
      expect(Number.isInteger(value.answer)).toBe(true);
    }
  });
});
