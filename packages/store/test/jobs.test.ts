import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { expect, it } from "vitest";
import {
  ConflictError,
  MIGRATIONS,
  type Model,
  migrate,
  NotFoundError,
  openStore,
  PostgresSql,
  SqliteSql,
  type TrainingJob,
} from "../src/index.ts";
import { describeBackends, PG_URL, unique } from "./helpers.ts";

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

  it("when jobs are asked for their progress, then each gets its latest step and first start's total, in one read", async () => {
    const entity = unique("ent");
    const stepped = await ctx.store.jobs.enqueue({
      type: "sft",
      model_id: (await newModel(entity)).id,
      entity,
    });
    const fresh = await ctx.store.jobs.enqueue({
      type: "sft",
      model_id: (await newModel(entity)).id,
      entity,
    });
    const events: [string, Record<string, number>][] = [
      ["training_started", { num_sequences: 6 }],
      ["gradient_step", { gradient_step: 1, loss: 2.5 }],
      ["gradient_step", { gradient_step: 2, loss: 1.5, reward: 0.25 }],
      ["training_started", { num_sequences: 6, resumed_from_step: 2, attempt: 2 }],
    ];
    for (const [type, data] of events) await ctx.store.jobs.appendEvent(stepped.id, type, data);
    await ctx.store.jobs.appendEvent(fresh.id, "training_started", { num_sequences: 3 });
    const progress = await ctx.store.jobs.progress([stepped.id, fresh.id, stepped.id]);
    expect([...progress]).toEqual([
      [stepped.id, { step: 2, total_steps: 6, loss: 1.5, reward: 0.25 }],
    ]);
    expect(await ctx.store.jobs.progress([])).toEqual(new Map());
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

  it("when a step is reported again, then the repeat is ignored and the first report stands", async () => {
    const entity = unique("ent");
    const model = await newModel(entity);
    const job = await ctx.store.jobs.enqueue({ type: "sft", model_id: model.id, entity });
    const append = (type: string, data: Record<string, number>) =>
      ctx.store.jobs.appendEvent(job.id, type, data);
    expect(await append("training_started", { num_sequences: 3 })).toBeDefined();
    expect(await append("gradient_step", { gradient_step: 1, loss: 1 })).toBeDefined();
    expect(await append("gradient_step", { gradient_step: 2, loss: 0.5 })).toBeDefined();
    expect(await append("checkpoint_saved", { step: 2 })).toBeDefined();
    // A resumed run: started again, then steps 2 (already reported) and 3.
    expect(
      await append("training_started", { num_sequences: 3, resumed_from_step: 1 }),
    ).toBeDefined();
    expect(await append("gradient_step", { gradient_step: 2, loss: 0.49 })).toBeUndefined();
    expect(await append("checkpoint_saved", { step: 2 })).toBeUndefined();
    expect(await append("gradient_step", { gradient_step: 3, loss: 0.25 })).toBeDefined();
    // Each type has its own steps; an event without an integer step is never a repeat.
    expect(await append("checkpoint_saved", { step: 3 })).toBeDefined();
    expect(await append("gradient_step", { loss: 0.1 })).toBeDefined();
    expect(await append("gradient_step", { loss: 0.1 })).toBeDefined();
    expect(await append("gradient_step", { gradient_step: 2.5 })).toBeDefined();
    // Another job's step 1 is its own.
    const other = await ctx.store.jobs.enqueue({ type: "sft", model_id: model.id, entity });
    expect(
      await ctx.store.jobs.appendEvent(other.id, "gradient_step", { gradient_step: 1 }),
    ).toBeDefined();

    const events = (await ctx.store.jobs.listEvents(entity, job.id, { limit: 100 })).data;
    expect(events.map((e) => [e.sequence, e.type, e.data])).toEqual([
      [1, "training_started", { num_sequences: 3 }],
      [2, "gradient_step", { gradient_step: 1, loss: 1 }],
      [3, "gradient_step", { gradient_step: 2, loss: 0.5 }],
      [4, "checkpoint_saved", { step: 2 }],
      [5, "training_started", { num_sequences: 3, resumed_from_step: 1 }],
      [6, "gradient_step", { gradient_step: 3, loss: 0.25 }],
      [7, "checkpoint_saved", { step: 3 }],
      [8, "gradient_step", { loss: 0.1 }],
      [9, "gradient_step", { loss: 0.1 }],
      [10, "gradient_step", { gradient_step: 2.5 }],
    ]);
  });

  it("when events were stored before steps were keyed, then migrating to version 6 keys each step's first report", async () => {
    const dir = join(ctx.dataDir, "v5-events");
    mkdirSync(dir, { recursive: true });
    const schema = `${ctx.schema}_v5e`;
    const fresh =
      ctx.backend === "sqlite"
        ? new SqliteSql({ path: join(dir, "arbor.db") })
        : new PostgresSql({ connectionString: PG_URL, schema });
    if (ctx.backend === "postgres") await fresh.exec(`CREATE SCHEMA ${schema}`);
    try {
      await migrate(fresh, MIGRATIONS.slice(0, 5));
      await fresh.exec("INSERT INTO entities (name, created_at) VALUES ('e', 0)");
      await fresh.exec(
        `INSERT INTO models (id, entity, project, name, base_model, created_at)
         VALUES ('m', 'e', 'p', 'n', 'b', 0)`,
      );
      for (const [job, status] of [
        ["j1", "running"],
        ["j2", "succeeded"],
      ])
        await fresh.exec(
          `INSERT INTO training_jobs (id, type, model_id, entity, status, created_at)
           VALUES ($1, 'sft', 'm', 'e', $2, 0)`,
          [job, status],
        );
      const stored: [string, string, object][] = [
        ["j1", "training_started", { num_sequences: 4 }],
        ["j1", "gradient_step", { gradient_step: 1, loss: 1 }],
        ["j1", "gradient_step", { gradient_step: 2, loss: 0.5 }],
        ["j1", "checkpoint_saved", { step: 1 }],
        ["j1", "training_started", { num_sequences: 4 }],
        // Reported twice before the key: both stay, the first is the step's report.
        ["j1", "gradient_step", { gradient_step: 2, loss: 0.49 }],
        ["j1", "gradient_step", { gradient_step: 3, loss: 0.25 }],
        ["j2", "gradient_step", { gradient_step: 1, loss: 2 }],
      ];
      for (const [i, [job, type, data]] of stored.entries())
        await fresh.exec(
          `INSERT INTO job_events (job_id, sequence, id, type, data, created_at)
           VALUES ($1, $2, $3, $4, $5, 0)`,
          [job, i + 1, `event-${i}`, type, JSON.stringify(data)],
        );
      expect(await migrate(fresh, MIGRATIONS.slice(0, 6))).toEqual([6]);
      const steps = await fresh.query<{ id: string; step: number | null }>(
        "SELECT id, step FROM job_events ORDER BY sequence",
      );
      expect(steps.map((r) => [r.id, r.step === null ? null : Number(r.step)])).toEqual([
        ["event-0", null],
        ["event-1", 1],
        ["event-2", 2],
        ["event-3", 1],
        ["event-4", null],
        ["event-5", null],
        ["event-6", 3],
        ["event-7", 1],
      ]);
      await fresh.close();
      const store = await openStore(
        ctx.backend === "sqlite"
          ? { dataDir: dir }
          : { databaseUrl: PG_URL, schema, blobDir: join(dir, "blobs") },
      );
      try {
        const append = (job: string, type: string, data: object) =>
          store.jobs.appendEvent(job, type, data as Record<string, number>);
        expect(await append("j1", "gradient_step", { gradient_step: 2 })).toBeUndefined();
        expect(await append("j1", "gradient_step", { gradient_step: 3 })).toBeUndefined();
        expect(await append("j1", "checkpoint_saved", { step: 1 })).toBeUndefined();
        expect(await append("j2", "gradient_step", { gradient_step: 1 })).toBeUndefined();
        expect(await append("j1", "gradient_step", { gradient_step: 4 })).toMatchObject({
          sequence: 8,
        });
        expect((await store.jobs.listEvents("e", "j1", { limit: 100 })).data).toHaveLength(8);
      } finally {
        await store.close();
      }
    } finally {
      if (ctx.backend === "postgres")
        await ctx.store.sql.exec(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
    }
  });

  it("when two workers report the same step at once, then it is reported once", async () => {
    const entity = unique("ent");
    const job = await ctx.store.jobs.enqueue({
      type: "sft",
      model_id: (await newModel(entity)).id,
      entity,
    });
    const stores = [ctx.store, await ctx.openAnother(), await ctx.openAnother()];
    const results = await Promise.all(
      stores.flatMap((store, w) =>
        [1, 2, 3].map((step) =>
          store.jobs.appendEvent(job.id, "gradient_step", { gradient_step: step, worker: w }),
        ),
      ),
    );
    expect(results.filter((r) => r !== undefined)).toHaveLength(3);
    const events = (await ctx.store.jobs.listEvents(entity, job.id)).data;
    expect(events.map((e) => e.sequence)).toEqual([1, 2, 3]);
    expect(events.map((e) => (e.data as { gradient_step: number }).gradient_step).sort()).toEqual([
      1, 2, 3,
    ]);
  });

  it("when a job is completed, cancelled, failed and reclaimed at once, then it has exactly one terminal event", async () => {
    await drain();
    const entity = unique("ent");
    const model = await newModel(entity);
    const [a, b] = [await ctx.openAnother(), await ctx.openAnother()];
    for (let round = 0; round < 5; round++) {
      const job = await ctx.store.jobs.enqueue({ type: "rl", model_id: model.id, entity });
      await ctx.store.jobs.claimNextJob("w", 1000);
      ctx.time += 1001;
      const outcomes = await Promise.allSettled([
        ctx.store.jobs.completeJob("w", job.id),
        a.jobs.cancelJob(entity, job.id),
        b.jobs.failJob("w", job.id, "boom"),
        a.jobs.reclaimExpiredLeases(),
      ]);
      for (const o of outcomes)
        if (o.status === "rejected") expect(o.reason).toBeInstanceOf(ConflictError);
      const events = (await ctx.store.jobs.listEvents(entity, job.id)).data;
      expect(events).toHaveLength(1);
      expect(["training_ended", "training_failed"]).toContain(events[0]!.type);
      // Whoever came first ended it (a reclaim first requeues it, and the cancel ends it).
      const after = await ctx.store.jobs.get(entity, job.id);
      expect(["succeeded", "cancelled", "failed"]).toContain(after?.status);
    }
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
