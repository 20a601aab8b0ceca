import { expect, it } from "vitest";
import type { Model } from "../src/index.ts";
import { describeBackends, unique } from "./helpers.ts";

/** OpenAI's fine-tuning jobs beside their training jobs, pausing, and trained tokens (ADR 70). */
describeBackends("fine-tuning jobs", (ctx) => {
  const newModel = async (entity: string): Promise<Model> => {
    await ctx.store.entities.ensure(entity);
    return (
      await ctx.store.models.create({ entity, project: "p", name: unique("m"), base_model: "b" })
    ).model;
  };
  const drain = () =>
    ctx.store.sql.exec(
      "UPDATE training_jobs SET status = 'cancelled', paused_at = NULL WHERE status IN ('queued', 'running')",
    );
  const newJob = async (entity: string, metadata: Record<string, string> | null = null) => {
    const model = await newModel(entity);
    const job = await ctx.store.jobs.enqueue({
      type: "sft",
      model_id: model.id,
      entity,
      payload_ref: "dataset://d",
    });
    const ft = await ctx.store.fineTuningJobs.create({
      id: `ftjob-${job.id.replaceAll("-", "")}`,
      job_id: job.id,
      entity,
      fine_tuned_model: `ft:b:${entity}::${job.id.slice(-8)}`,
      base_model: "b",
      training_file: "file-1",
      validation_file: null,
      suffix: null,
      seed: 1,
      method: { type: "supervised" },
      hyperparameters: { n_epochs: 1 },
      metadata,
    });
    return { model, job, ft };
  };

  it("when a job is created, then it is found by id and by its model's name, only by its entity", async () => {
    const entity = unique("ent");
    const { ft } = await newJob(entity, { team: "a" });
    expect(await ctx.store.fineTuningJobs.get([entity], ft.id)).toEqual(ft);
    expect(await ctx.store.fineTuningJobs.get(["other"], ft.id)).toBeUndefined();
    expect(await ctx.store.fineTuningJobs.byFineTunedModel([entity], ft.fine_tuned_model)).toEqual(
      ft,
    );
    expect(
      await ctx.store.fineTuningJobs.byFineTunedModel(["other"], ft.fine_tuned_model),
    ).toBeUndefined();
    expect(ft).toMatchObject({
      metadata: { team: "a" },
      method: { type: "supervised" },
      trained_tokens: null,
    });
  });

  it("when jobs are listed by metadata, then pages are newest first and hold only matching jobs", async () => {
    const entity = unique("ent");
    const made = [];
    for (const team of ["a", "b", "a", "b", "a"]) made.push((await newJob(entity, { team })).ft.id);
    await newJob(entity, null);
    const a = made.filter((_, i) => i % 2 === 0).reverse();
    const first = await ctx.store.fineTuningJobs.list([entity], {
      limit: 2,
      metadata: { team: "a" },
    });
    expect(first.data.map((j) => j.id)).toEqual(a.slice(0, 2));
    expect(first.has_more).toBe(true);
    const second = await ctx.store.fineTuningJobs.list([entity], {
      limit: 2,
      after: first.last_id!,
      metadata: { team: "a" },
    });
    expect(second.data.map((j) => j.id)).toEqual(a.slice(2));
    expect(second.has_more).toBe(false);
    expect((await ctx.store.fineTuningJobs.list([entity], { metadata: null })).data).toHaveLength(
      1,
    );
    expect((await ctx.store.fineTuningJobs.list([entity])).data).toHaveLength(6);
  });

  it("when a job is paused, then it is not claimed until resumed, and a running one loses its lease", async () => {
    await drain();
    const entity = unique("ent");
    const { job } = await newJob(entity);
    const paused = await ctx.store.jobs.pauseJob(entity, job.id);
    expect(paused).toMatchObject({ status: "queued", paused_at: expect.any(Number) });
    expect(await ctx.store.jobs.pauseJob(entity, job.id)).toBeUndefined();
    expect(await ctx.store.jobs.claimNextJob("w1", 60_000)).toBeUndefined();
    expect((await ctx.store.jobs.list(entity, { status: "paused" })).data.map((j) => j.id)).toEqual(
      [job.id],
    );
    expect((await ctx.store.jobs.list(entity, { status: "queued" })).data).toEqual([]);

    expect(await ctx.store.jobs.resumeJob(entity, job.id)).toMatchObject({ paused_at: null });
    expect(await ctx.store.jobs.resumeJob(entity, job.id)).toBeUndefined();
    const claimed = await ctx.store.jobs.claimNextJob("w1", 60_000);
    expect(claimed?.id).toBe(job.id);
    expect(await ctx.store.jobs.pauseJob(entity, job.id)).toMatchObject({
      status: "queued",
      lease_owner: null,
    });
    expect(await ctx.store.jobs.stillHeld("w1", job.id)).toBe(false);
    expect((await ctx.store.jobs.get(entity, job.id))?.crashes).toBe(0);
    // A cancel ends a paused job, and it is paused no more.
    const cancelled = await ctx.store.jobs.cancelJob(entity, job.id);
    expect(cancelled).toMatchObject({ status: "cancelled", paused_at: null });
  });

  it("when a job's steps are summed, then its trained tokens are their num_tokens, each step once", async () => {
    const entity = unique("ent");
    const { job, ft } = await newJob(entity);
    for (const [step, tokens] of [
      [1, 100],
      [2, 250],
      [2, 999],
      [3, 50],
    ] as const) {
      await ctx.store.jobs.appendEvent(job.id, "gradient_step", {
        gradient_step: step,
        num_tokens: tokens,
      });
    }
    await ctx.store.jobs.appendEvent(job.id, "checkpoint_saved", { step: 3 });
    expect(await ctx.store.jobs.trainedTokens(job.id)).toBe(400);
    await ctx.store.fineTuningJobs.setTrainedTokens(ft.id, 400);
    expect((await ctx.store.fineTuningJobs.get([entity], ft.id))?.trained_tokens).toBe(400);
  });
});
