import { expect, it } from "vitest";
import { InvalidInputError, NotFoundError } from "../src/index.ts";
import { describeBackends, unique } from "./helpers.ts";

/** What the store refuses, and races it settles, identically on both backends. */
describeBackends("input the store refuses, and concurrent deletes", (ctx) => {
  const newModel = async () => {
    const entity = unique("ent");
    await ctx.store.entities.ensure(entity);
    const { model } = await ctx.store.models.create({
      entity,
      project: "proj",
      name: unique("m"),
      base_model: "tiny/base",
      initialCheckpoint: {},
    });
    return model;
  };

  it.each([
    ["a NUL in a model name", { project: "p", name: "a\u0000b" }],
    ["a name of 129 characters", { project: "p", name: "x".repeat(129) }],
    ["the name ..", { project: "p", name: ".." }],
    ["a slash in a project", { project: "a/b", name: "n" }],
  ])(
    "when a model is created with %s, then InvalidInputError and nothing is stored",
    async (_, names) => {
      const entity = unique("ent");
      await ctx.store.entities.ensure(entity);
      await expect(
        ctx.store.models.create({ entity, base_model: "b", ...names, initialCheckpoint: {} }),
      ).rejects.toBeInstanceOf(InvalidInputError);
      expect((await ctx.store.models.list(entity)).data).toEqual([]);
    },
  );

  it("when a call id carries a NUL, then InvalidInputError on every backend", async () => {
    await expect(
      ctx.store.calls.startCall({
        project_id: "e/p",
        id: "bad\u0000id",
        op_name: "op",
        started_at: new Date().toISOString(),
      }),
    ).rejects.toBeInstanceOf(InvalidInputError);
  });

  it("when a call's exception and usage carry NUL, then they are stored and usage still sums", async () => {
    const project = `${unique("e")}/p`;
    const id = unique("call");
    await ctx.store.calls.startCall({
      project_id: project,
      id,
      op_name: "op",
      started_at: new Date(),
    });
    await ctx.store.calls.endCall({
      project_id: project,
      id,
      ended_at: new Date(),
      exception: "boom\u0000",
      summary: {
        usage: { "m\u0000": { prompt_tokens: 3 }, m: { prompt_tokens: 2 } },
        note: "\u0000",
      },
    });
    expect((await ctx.store.calls.getCall(project, id))?.exception).toBe("boom\ufffd");
    const usage = await ctx.store.calls.callUsage(project, [id]);
    expect(usage.call_usage[id]?.m?.prompt_tokens).toBe(2);
  });

  it("when a call's free-form fields hold lone surrogates, then they are kept and usage still sums; in an id, refused", async () => {
    const project = `${unique("e")}/p`;
    const id = unique("call");
    await ctx.store.calls.startCall({
      project_id: project,
      id,
      op_name: "op",
      started_at: new Date(),
      inputs: { text: "\ud800 alone" },
    });
    await ctx.store.calls.endCall({
      project_id: project,
      id,
      ended_at: new Date(),
      summary: {
        usage: { "m\udfff": { prompt_tokens: 1 }, m: { prompt_tokens: 4 } },
        note: "\ud83d",
      },
    });
    expect((await ctx.store.calls.getCall(project, id))?.inputs).toEqual({ text: "\ud800 alone" });
    const usage = await ctx.store.calls.callUsage(project, [id]);
    expect(usage.call_usage[id]?.m?.prompt_tokens).toBe(4);
    expect(usage.call_usage[id]?.["m\ufffd"]?.prompt_tokens).toBe(1);
    await expect(ctx.store.calls.callUsage(project, ["\ud800"])).rejects.toBeInstanceOf(
      InvalidInputError,
    );
  });

  it("when a requested call id is __proto__, then it is answered as a key like any other", async () => {
    const usage = await ctx.store.calls.callUsage(`${unique("e")}/p`, ["__proto__"]);
    expect(JSON.stringify(usage.call_usage)).toBe('{"__proto__":{}}');
  });

  it("when 40,000 steps are deleted at once, then the answer lists the missing ones", async () => {
    const model = await newModel();
    const steps = Array.from({ length: 40_000 }, (_, i) => i + 1);
    const result = await ctx.store.models.deleteCheckpoints(model.entity, model.id, steps);
    expect(result.deleted_count).toBe(0);
    expect(result.not_found_steps).toHaveLength(40_000);
  });

  it("when 20 callers delete one model at once on 3 handles, then exactly one succeeds and the rest see it missing", async () => {
    const model = await newModel();
    const stores = [ctx.store, await ctx.openAnother(), await ctx.openAnother()];
    const results = await Promise.allSettled(
      Array.from({ length: 20 }, (_, i) => stores[i % 3]!.models.delete(model.entity, model.id)),
    );
    expect(results.filter((r) => r.status === "fulfilled")).toHaveLength(1);
    for (const r of results.filter((r) => r.status === "rejected"))
      expect((r as PromiseRejectedResult).reason).toBeInstanceOf(NotFoundError);
  });
});
