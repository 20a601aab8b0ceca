import { expect, it } from "vitest";
import { ConflictError, NotFoundError } from "../src/index.ts";
import { describeBackends, unique } from "./helpers.ts";

describeBackends("models and checkpoints", (ctx) => {
  const newModel = async (entity = unique("ent")) => {
    await ctx.store.entities.ensure(entity);
    const { model } = await ctx.store.models.create({
      entity,
      project: "proj",
      name: unique("m"),
      base_model: "tiny/base",
      initialCheckpoint: { blob_key: "k0" },
    });
    return model;
  };

  it("when a model is created with an initial checkpoint, then latest_step is 0 and step 0 is listed", async () => {
    const model = await newModel();
    expect(model.latest_step).toBe(0);
    const page = await ctx.store.models.listCheckpoints(model.entity, model.id);
    expect(page.data.map((c) => c.step)).toEqual([0]);
    expect(page.data[0]?.blob_key).toBe("k0");
  });

  it.each([
    { callers: 2, handles: 1 },
    { callers: 2, handles: 2 },
    { callers: 6, handles: 3 },
  ])(
    "when $callers callers on $handles handles create the same model at once, then exactly one exists and the rest get ConflictError",
    async ({ callers, handles }) => {
      const entity = unique("ent");
      await ctx.store.entities.ensure(entity);
      const stores = [ctx.store];
      for (let h = 1; h < handles; h++) stores.push(await ctx.openAnother());
      const input = { entity, project: "p", name: "dup", base_model: "b", initialCheckpoint: {} };
      const results = await Promise.allSettled(
        Array.from({ length: callers }, (_, i) => stores[i % handles]!.models.create(input)),
      );
      const ok = results.filter((r) => r.status === "fulfilled");
      const failed = results.filter((r) => r.status === "rejected");
      expect(ok).toHaveLength(1);
      expect(failed).toHaveLength(callers - 1);
      for (const f of failed)
        expect((f as PromiseRejectedResult).reason).toBeInstanceOf(ConflictError);
      const rows = await ctx.store.sql.query("SELECT id FROM models WHERE entity = $1", [entity]);
      expect(rows).toHaveLength(1);
      const checkpoints = await ctx.store.sql.query(
        "SELECT c.id FROM checkpoints c JOIN models m ON m.id = c.model_id WHERE m.entity = $1",
        [entity],
      );
      expect(checkpoints).toHaveLength(1);
    },
  );

  it("when returnExisting is set, then a duplicate returns the existing model", async () => {
    const model = await newModel();
    const again = await ctx.store.models.create(
      { entity: model.entity, project: model.project, name: model.name, base_model: "x" },
      { returnExisting: true },
    );
    expect(again).toEqual({ model, created: false });
  });

  it("when another entity asks, then the model reads as missing", async () => {
    const model = await newModel();
    expect(await ctx.store.models.get(model.entity, model.id)).toEqual(model);
    expect(await ctx.store.models.get("intruder", model.id)).toBeUndefined();
    expect(await ctx.store.models.getByName("intruder", model.project, model.name)).toBeUndefined();
    expect((await ctx.store.models.listCheckpoints("intruder", model.id)).data).toEqual([]);
    await expect(ctx.store.models.delete("intruder", model.id)).rejects.toBeInstanceOf(
      NotFoundError,
    );
    await expect(
      ctx.store.models.addCheckpoint("intruder", model.id, { step: 1 }),
    ).rejects.toBeInstanceOf(NotFoundError);
  });

  it("when models are listed, then pages follow creation order without skips or repeats", async () => {
    const entity = unique("ent");
    const ids: string[] = [];
    for (let i = 0; i < 5; i++) ids.push((await newModel(entity)).id);
    const seen: string[] = [];
    let after: string | null = null;
    for (;;) {
      const page = await ctx.store.models.list(entity, { after, limit: 2 });
      seen.push(...page.data.map((m) => m.id));
      if (!page.has_more) break;
      after = page.last_id;
      // A model created while paging shows up at the end, never in the middle.
      if (seen.length === 2) ids.push((await newModel(entity)).id);
    }
    expect(seen).toEqual(ids);
    const last = await ctx.store.models.list(entity, { after: ids[ids.length - 1]!, limit: 2 });
    expect(last).toEqual({ data: [], first_id: null, last_id: null, has_more: false });
    expect((await ctx.store.models.list([entity, "nobody"], { limit: 100 })).data).toHaveLength(6);
  });

  it("when checkpoints are added, paged both ways, merged and deleted, then the rules hold", async () => {
    const model = await newModel();
    for (const step of [1, 2, 3]) {
      await ctx.store.models.addCheckpoint(model.entity, model.id, {
        step,
        blob_key: `k${step}`,
        metrics: { loss: 1 / step },
      });
    }
    expect((await ctx.store.models.get(model.entity, model.id))?.latest_step).toBe(3);
    await expect(
      ctx.store.models.addCheckpoint(model.entity, model.id, { step: 2 }),
    ).rejects.toBeInstanceOf(ConflictError);

    const asc1 = await ctx.store.models.listCheckpoints(model.entity, model.id, { limit: 2 });
    expect(asc1.data.map((c) => c.step)).toEqual([0, 1]);
    expect(asc1.has_more).toBe(true);
    const asc2 = await ctx.store.models.listCheckpoints(model.entity, model.id, {
      limit: 2,
      after: asc1.last_id,
    });
    expect(asc2.data.map((c) => c.step)).toEqual([2, 3]);
    expect(asc2.has_more).toBe(false);
    const desc = await ctx.store.models.listCheckpoints(model.entity, model.id, {
      order: "desc",
      limit: 3,
    });
    expect(desc.data.map((c) => c.step)).toEqual([3, 2, 1]);

    const merged = await ctx.store.models.mergeCheckpointMetrics(model.entity, model.id, 3, {
      "train/reward": 0.5,
    });
    expect(merged.metrics).toEqual({ loss: 1 / 3, "train/reward": 0.5 });
    expect((await ctx.store.models.getCheckpoint(model.entity, model.id))?.step).toBe(3);
    expect((await ctx.store.models.getCheckpoint(model.entity, model.id, 1))?.metrics).toEqual({
      loss: 1,
    });

    await expect(
      ctx.store.models.deleteCheckpoints(model.entity, model.id, [3]),
    ).rejects.toBeInstanceOf(ConflictError);
    const deleted = await ctx.store.models.deleteCheckpoints(model.entity, model.id, [1, 2, 9, 1]);
    expect(deleted).toEqual({ deleted_count: 2, not_found_steps: [9], blob_keys: ["k1", "k2"] });

    const gone = await ctx.store.models.delete(model.entity, model.id);
    expect(gone.deleted_checkpoints).toBe(2);
    expect(gone.blob_keys.sort()).toEqual(["k0", "k3"]);
    expect(await ctx.store.models.get(model.entity, model.id)).toBeUndefined();
  });

  it("when checkpoints are added on several handles while the model is deleted, then each add succeeds or finds the model gone, and none is left", async () => {
    const stores = [ctx.store, await ctx.openAnother(), await ctx.openAnother()];
    for (let round = 0; round < 5; round++) {
      const model = await newModel();
      const adds = Array.from({ length: 6 }, (_, i) =>
        stores[i % stores.length]!.models.addCheckpoint(model.entity, model.id, {
          step: i + 1,
          blob_key: `k${i + 1}`,
        }),
      );
      const deleted = stores[1]!.models.delete(model.entity, model.id);
      for (const result of await Promise.allSettled([...adds, deleted])) {
        if (result.status === "rejected") expect(result.reason).toBeInstanceOf(NotFoundError);
      }
      await expect(deleted).resolves.toBeDefined();
      const page = await ctx.store.models.listCheckpoints(model.entity, model.id);
      expect(page.data).toEqual([]);
    }
  });
});

describeBackends("datasets", (ctx) => {
  it("when a dataset is created, then only its entity sees it", async () => {
    const entity = unique("ent");
    await ctx.store.entities.ensure(entity);
    const id = ctx.store.datasets.newId();
    const ds = await ctx.store.datasets.create({
      id,
      entity,
      name: "train",
      blob_key: `datasets/${id}.jsonl`,
      bytes: 10,
      lines: 2,
    });
    expect(ds).toMatchObject({ id, entity, name: "train", bytes: 10, lines: 2 });
    expect(await ctx.store.datasets.get(entity, id)).toEqual(ds);
    expect(await ctx.store.datasets.get("other", id)).toBeUndefined();
    expect((await ctx.store.datasets.list(entity)).data).toEqual([ds]);
    expect(await ctx.store.datasets.delete("other", id)).toBeUndefined();
    expect(await ctx.store.datasets.delete(entity, id)).toEqual(ds);
    expect(await ctx.store.datasets.get(entity, id)).toBeUndefined();
  });
});
