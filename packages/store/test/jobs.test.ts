import { expect, it } from "vitest";
import { ConflictError, type Model, NotFoundError, type TrainingJob } from "../src/index.ts";
import { describeBackends, unique } from "./helpers.ts";

describeBackends("training jobs and the queue", (ctx) => {
  const newModel = async (entity: string): Promise<Model> => {
    await ctx.store.entities.ensure(entity);
    return (
      await ctx.store.models.create({ entity, project: "p", name: unique("m"), base_model: "b" })
    ).model;
  };
  /** Each test drains the queue first so jobs left by earlier tests do not interfere. */
  const drain = async () => {
    await ctx.store.sql.exec(
      "UPDATE training_jobs SET status = 'cancelled' WHERE status IN ('queued', 'running')",
    );
  };

  it("when a job is enqueued, then it is queued, scoped to its entity, and listed", async () => {
    const entity = unique("ent");
    const model = await newModel(entity);
    const job = await ctx.store.jobs.enqueue({
      type: "sft",
      model_id: model.id,
      entity,
      config: { learning_rate: 0.01 },
      payload_ref: "dataset://x",
    });
    expect(job).toMatchObject({
      status: "queued",
      type: "sft",
      attempts: 0,
      crashes: 0,
      config: { learning_rate: 0.01 },
    });
    expect(await ctx.store.jobs.get(entity, job.id)).toEqual(job);
    expect(await ctx.store.jobs.get("other", job.id)).toBeUndefined();
    expect((await ctx.store.jobs.list(entity)).data).toEqual([job]);
    await expect(
      ctx.store.jobs.enqueue({ type: "rl", model_id: model.id, entity: "other" }),
    ).rejects.toBeInstanceOf(NotFoundError);
  });

  it("when jobs of one model are queued, then they run one at a time in creation order", async () => {
    await drain();
    const entity = unique("ent");
    const a = await newModel(entity);
    const b = await newModel(entity);
    const a1 = await ctx.store.jobs.enqueue({ type: "rl", model_id: a.id, entity });
    const a2 = await ctx.store.jobs.enqueue({ type: "rl", model_id: a.id, entity });
    const b1 = await ctx.store.jobs.enqueue({ type: "rl", model_id: b.id, entity });

    const first = await ctx.store.jobs.claimNextJob("w1", 10_000);
    expect(first?.id).toBe(a1.id);
    expect(first).toMatchObject({ status: "running", lease_owner: "w1", attempts: 1 });
    expect(first?.training_start).not.toBeNull();
    // a2 must wait for a1; b1 is free.
    expect((await ctx.store.jobs.claimNextJob("w2", 10_000))?.id).toBe(b1.id);
    expect(await ctx.store.jobs.claimNextJob("w3", 10_000)).toBeUndefined();

    await ctx.store.jobs.appendEvent(a1.id, "training_started", { num_sequences: 1 });
    await ctx.store.jobs.updateProgress("w1", a1.id, { step_from: 0, step_to: 1 });
    await expect(ctx.store.jobs.completeJob("intruder", a1.id)).rejects.toBeInstanceOf(
      ConflictError,
    );
    const done = await ctx.store.jobs.completeJob("w1", a1.id);
    expect(done).toMatchObject({
      status: "succeeded",
      step_from: 0,
      step_to: 1,
      lease_owner: null,
    });
    expect((await ctx.store.jobs.claimNextJob("w3", 10_000))?.id).toBe(a2.id);

    const events = await ctx.store.jobs.listEvents(entity, a1.id);
    expect(events.data.map((e) => [e.sequence, e.type])).toEqual([
      [1, "training_started"],
      [2, "training_ended"],
    ]);
    expect((await ctx.store.jobs.listEvents("other", a1.id)).data).toEqual([]);
    const after = await ctx.store.jobs.listEvents(entity, a1.id, { after: events.data[0]!.id });
    expect(after.data.map((e) => e.type)).toEqual(["training_ended"]);
  });

  it("when a running job fails or is cancelled, then exactly one terminal event is written", async () => {
    await drain();
    const entity = unique("ent");
    const model = await newModel(entity);
    const failing = await ctx.store.jobs.enqueue({ type: "rl", model_id: model.id, entity });
    await ctx.store.jobs.claimNextJob("w", 10_000);
    const failed = await ctx.store.jobs.failJob("w", failing.id, "line 3: bad JSON");
    expect(failed).toMatchObject({ status: "failed", error_message: "line 3: bad JSON" });
    await expect(ctx.store.jobs.failJob("w", failing.id, "again")).rejects.toBeInstanceOf(
      ConflictError,
    );

    const queued = await ctx.store.jobs.enqueue({ type: "rl", model_id: model.id, entity });
    const running = await ctx.store.jobs.enqueue({
      type: "rl",
      model_id: (await newModel(entity)).id,
      entity,
    });
    expect((await ctx.store.jobs.claimNextJob("w", 10_000))?.id).toBe(queued.id);
    expect(await ctx.store.jobs.stillHeld("w", queued.id)).toBe(true);
    expect(await ctx.store.jobs.stillHeld("other-worker", queued.id)).toBe(false);
    const cancelledQueued = await ctx.store.jobs.cancelJob(entity, running.id);
    expect(cancelledQueued.status).toBe("cancelled");
    const cancelledRunning = await ctx.store.jobs.cancelJob(entity, queued.id);
    expect(cancelledRunning).toMatchObject({ status: "cancelled", error_message: "cancelled" });
    expect(await ctx.store.jobs.renewLease("w", queued.id, 10_000)).toBe(false);
    expect(await ctx.store.jobs.stillHeld("w", queued.id)).toBe(false);
    // Cancelling again changes nothing and writes no second event.
    expect((await ctx.store.jobs.cancelJob(entity, queued.id)).status).toBe("cancelled");
    await expect(ctx.store.jobs.cancelJob("other", queued.id)).rejects.toBeInstanceOf(
      NotFoundError,
    );

    for (const job of [failing, queued, running]) {
      const types = (await ctx.store.jobs.listEvents(entity, job.id)).data.map((e) => e.type);
      expect(types.filter((t) => t === "training_failed" || t === "training_ended")).toHaveLength(
        1,
      );
    }
    const cancelEvent = (await ctx.store.jobs.listEvents(entity, queued.id)).data.at(-1);
    expect(cancelEvent?.data).toEqual({ error_message: "cancelled" });
  });

  it("when a lease expires, then the job is queued again, and failed when its worker dies a second time", async () => {
    await drain();
    const entity = unique("ent");
    const model = await newModel(entity);
    const job = await ctx.store.jobs.enqueue({ type: "rl", model_id: model.id, entity });
    const reclaimed: string[] = [];
    for (let attempt = 1; attempt <= 2; attempt++) {
      const claimed = await ctx.store.jobs.claimNextJob(`w${attempt}`, 1000);
      expect(claimed).toMatchObject({ id: job.id, attempts: attempt, crashes: attempt - 1 });
      ctx.time += 500;
      expect(await ctx.store.jobs.renewLease(`w${attempt}`, job.id, 1000)).toBe(true);
      expect(await ctx.store.jobs.reclaimExpiredLeases()).toEqual({ requeued: [], failed: [] });
      ctx.time += 1001;
      const result = await ctx.store.jobs.reclaimExpiredLeases();
      if (attempt < 2) {
        expect(result.failed).toEqual([]);
        expect(result.requeued.map((j: TrainingJob) => [j.id, j.status])).toEqual([
          [job.id, "queued"],
        ]);
        reclaimed.push("requeued");
        // The dead worker can no longer finish it.
        expect(await ctx.store.jobs.renewLease(`w${attempt}`, job.id, 1000)).toBe(false);
      } else {
        expect(result.requeued).toEqual([]);
        expect(result.failed.map((j: TrainingJob) => [j.id, j.status])).toEqual([
          [job.id, "failed"],
        ]);
        reclaimed.push("failed");
      }
    }
    expect(reclaimed).toEqual(["requeued", "failed"]);
    const events = (await ctx.store.jobs.listEvents(entity, job.id)).data;
    expect(events.map((e) => e.type)).toEqual(["training_failed"]);
    expect(events[0]?.data).toEqual({ error_message: expect.stringContaining("2 times") });
    expect((await ctx.store.jobs.depth()).running).toBe(0);
  });

  it("when a worker restarts, then it reclaims its earlier boot's running job at once, not another worker's", async () => {
    await drain();
    const entity = unique("ent");
    const mine = await ctx.store.jobs.enqueue({
      type: "rl",
      model_id: (await newModel(entity)).id,
      entity,
    });
    const theirs = await ctx.store.jobs.enqueue({
      type: "rl",
      model_id: (await newModel(entity)).id,
      entity,
    });
    await ctx.store.jobs.claimNextJob("host-a.0#boot1", 60_000);
    await ctx.store.jobs.claimNextJob("host-b.0#boot1", 60_000);
    // host-a.0 restarts as boot2, long before the lease would expire.
    const result = await ctx.store.jobs.reclaimOwnLeases("host-a.0#", "host-a.0#boot2");
    expect(result.requeued.map((j) => j.id)).toEqual([mine.id]);
    expect((await ctx.store.jobs.get(entity, theirs.id))?.status).toBe("running");
    expect(await ctx.store.jobs.get(entity, mine.id)).toMatchObject({
      status: "queued",
      crashes: 1,
    });
  });

  it("when a worker releases its job, then it is queued again and claimable", async () => {
    await drain();
    const entity = unique("ent");
    const model = await newModel(entity);
    const job = await ctx.store.jobs.enqueue({ type: "rl", model_id: model.id, entity });
    await ctx.store.jobs.claimNextJob("w1", 10_000);
    expect(await ctx.store.jobs.releaseJob("other", job.id)).toBe(false);
    expect(await ctx.store.jobs.releaseJob("w1", job.id)).toBe(true);
    expect((await ctx.store.jobs.get(entity, job.id))?.status).toBe("queued");
    expect(await ctx.store.jobs.claimNextJob("w2", 10_000)).toMatchObject({
      id: job.id,
      attempts: 2,
      lease_owner: "w2",
    });
  });

  it("when several workers claim at once, then no job is claimed twice and no model runs two jobs", async () => {
    await drain();
    const entity = unique("ent");
    const models = await Promise.all(Array.from({ length: 6 }, () => newModel(entity)));
    const jobs: TrainingJob[] = [];
    for (let round = 0; round < 4; round++) {
      for (const m of models)
        jobs.push(await ctx.store.jobs.enqueue({ type: "rl", model_id: m.id, entity }));
    }
    const workers = [
      ctx.store,
      await ctx.openAnother(),
      await ctx.openAnother(),
      await ctx.openAnother(),
    ];
    const claimedBy = new Map<string, string>();
    const running = new Map<string, string>();
    const claimOrder: TrainingJob[] = [];
    let violations = 0;
    await Promise.all(
      workers.map(async (store, w) => {
        for (;;) {
          const job = await store.jobs.claimNextJob(`worker-${w}`, 60_000);
          if (!job) {
            if (claimedBy.size === jobs.length) return;
            await new Promise((r) => setTimeout(r, 2));
            continue;
          }
          if (claimedBy.has(job.id)) violations++;
          claimedBy.set(job.id, `worker-${w}`);
          claimOrder.push(job);
          if (running.has(job.model_id)) violations++;
          running.set(job.model_id, job.id);
          await new Promise((r) => setTimeout(r, 1));
          running.delete(job.model_id);
          await store.jobs.completeJob(`worker-${w}`, job.id);
        }
      }),
    );
    expect(violations).toBe(0);
    expect(claimedBy.size).toBe(jobs.length);
    for (const m of models) {
      const byModel = (list: TrainingJob[]) =>
        list.filter((j) => j.model_id === m.id).map((j) => j.id);
      expect(byModel(claimOrder)).toEqual(byModel(jobs));
    }
    if (ctx.backend === "postgres") expect(new Set(claimedBy.values()).size).toBeGreaterThan(1);
    for (const job of jobs)
      expect((await ctx.store.jobs.get(entity, job.id))?.status).toBe("succeeded");
  });
});
