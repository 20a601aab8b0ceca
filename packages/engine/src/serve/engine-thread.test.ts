import { rmSync } from "node:fs";
import { describe, expect, it, vi } from "vitest";
import { PATIENT } from "../../../../vitest.shared.ts";
import { longContextTinyChat } from "../../test/fixtures.ts";
import { createWasmKernels } from "../kernels/wasm.ts";
import { catalogModelDir } from "../model/catalog.ts";
import { adapterToFiles, createLoraAdapter } from "../model/lora.ts";
import { loadModel } from "../model/model.ts";
import { Engine } from "./engine.ts";
import { EngineThread } from "./engine-thread.ts";
import { ContextLengthError } from "./prompt-encoder.ts";

describe("EngineThread", async () => {
  const dir = catalogModelDir("arbor/tiny-chat");
  const model = await loadModel(dir);
  const local = new Engine(model, { kernels: createWasmKernels("auto", { threads: 1 }) });
  const messages = [{ role: "user" as const, content: "What is 7 + 5?" }];

  it("when a chat runs on the thread, then its tokens and events equal the same engine's in this thread", async () => {
    const thread = await EngineThread.start(dir);
    try {
      const prompt = await thread.encodeChat(messages);
      expect(prompt).toEqual(await local.encodeChat(messages));
      const request = { prompt, maxTokens: 12, temperature: 0.8, seed: 3, n: 2, logprobs: true };
      const there = [];
      for await (const event of thread.generate(request)) there.push(event);
      const here = [];
      for await (const event of local.generate(request)) here.push(event);
      expect(there).toEqual(here);
      expect((await thread.stats()).steps).toBeGreaterThan(0);
    } finally {
      await thread.dispose();
    }
  });

  it("when an adapter is loaded under a key, then requests naming it generate with it", async () => {
    const thread = await EngineThread.start(dir);
    try {
      const adapter = createLoraAdapter(model, { baseModel: "arbor/tiny-chat" }, 5);
      for (const m of adapter.layers.flatMap((l) => Object.values(l))) m.b.fill(0.5);
      await thread.loadAdapter("ckpt", adapterToFiles(adapter));
      const prompt = await thread.encodeChat(messages);
      const run = async (key: string | null) => {
        const tokens: number[] = [];
        for await (const e of thread.generate({
          prompt,
          maxTokens: 8,
          temperature: 0,
          adapter: key,
        }))
          if (e.type === "token") tokens.push(e.token);
        return tokens;
      };
      const expected = await local.complete({ prompt, maxTokens: 8, temperature: 0, adapter });
      expect(await run("ckpt")).toEqual(expected.choices[0]!.tokens);
      expect(await run(null)).not.toEqual(await run("ckpt"));
      thread.dropAdapter("ckpt");
      await expect(run("ckpt")).rejects.toThrow(/not loaded/);
    } finally {
      await thread.dispose();
    }
  });

  it("when a request is aborted or a prompt cannot fit, then the thread says so and goes on", async () => {
    const thread = await EngineThread.start(dir);
    try {
      const prompt = await thread.encodeChat(messages);
      const controller = new AbortController();
      const stream = thread.generate(
        { prompt, maxTokens: 200, temperature: 1 },
        { signal: controller.signal },
      );
      await stream.next();
      controller.abort(new Error("client left"));
      await expect(stream.next()).rejects.toThrow("client left");
      await expect(
        thread.encodeChat([{ role: "user", content: "word ".repeat(100_000) }]),
      ).rejects.toBeInstanceOf(ContextLengthError);
      const refusal = await thread
        .encodeChat([{ role: "user", content: "7 + 5 ".repeat(60) }])
        .catch((e: unknown) => e);
      expect(refusal).toBeInstanceOf(ContextLengthError);
      // The scheduler drops the cancelled sequence at its next turn.
      await vi.waitFor(async () => expect((await thread.stats()).activeSequences).toBe(0), PATIENT);
    } finally {
      await thread.dispose();
    }
  });

  it("when a 5 KB chat is sent while a 30,000-letter word's prompt is served on a 131,072-token context, then the chat is answered first", async () => {
    const longDir = longContextTinyChat();
    const thread = await EngineThread.start(longDir);
    try {
      let seed = 7;
      const word = Array.from({ length: 30_000 }, () => {
        seed = (seed * 1103515245 + 12345) % 2 ** 31;
        return String.fromCharCode(97 + (seed % 26));
      }).join("");
      const order: string[] = [];
      const controller = new AbortController();
      const long = (async () => {
        const prompt = await thread.encodeChat([{ role: "user", content: word }]);
        expect(prompt.length).toBeGreaterThan(20_000);
        for await (const _ of thread.generate(
          { prompt, maxTokens: 1, temperature: 0 },
          { signal: controller.signal },
        ));
        order.push("long");
      })().catch((err: unknown) => {
        if (!controller.signal.aborted) throw err;
      });
      await vi.waitFor(
        async () => expect((await thread.stats()).steps).toBeGreaterThan(0),
        PATIENT,
      );
      const chat = [
        { role: "user" as const, content: "Hello there, how are you today? ".repeat(160) },
      ];
      const prompt = await thread.encodeChat(chat);
      const answer = [];
      for await (const event of thread.generate({ prompt, maxTokens: 4, temperature: 0 }))
        answer.push(event);
      order.push("short");
      expect(answer.at(-1)).toMatchObject({ type: "done", promptTokens: prompt.length });
      // The long prompt is still being prefilled; it is cancelled rather than waited for.
      controller.abort(new Error("client left"));
      await long;
      expect(order).toEqual(["short"]);
      await vi.waitFor(async () => expect((await thread.stats()).activeSequences).toBe(0), PATIENT);
    } finally {
      await thread.dispose();
      rmSync(longDir, { recursive: true, force: true });
    }
  });
});
