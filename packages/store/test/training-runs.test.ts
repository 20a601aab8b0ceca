import { expect, it } from "vitest";
import {
  ConflictError,
  DomainError,
  MAX_UNFINISHED_OPERATIONS,
  type OperationKind,
} from "../src/index.ts";
import { describeBackends, unique } from "./helpers.ts";

/** The native training runs' ledger (ADR 57): admission, its limits and order, restarts. */
describeBackends("native training runs", (ctx) => {
  const openRun = async () => {
    const entity = unique("ent");
    await ctx.store.entities.ensure(entity);
    return ctx.store.trainingRuns.resolve({
      entity,
      request_id: unique("resolve"),
      fingerprint: "f",
      run_name: null,
      spec: { base_model: "b" },
      initial: null,
    });
  };
  const command = (sequence: number, kind: OperationKind = "forward", request = unique("req")) => ({
    kind,
    request_id: request,
    fingerprint: `${kind}:${request}`,
    sequence_id: sequence,
    body: { request_id: request },
  });
  const refusal = (promise: Promise<unknown>) =>
    promise.then(
      () => null,
      (err: unknown) => (err instanceof DomainError ? err.code : String(err)),
    );

  it("when learner blob keys are asked about, then a run's committed state and a saved state are named until the saved state expires; other keys are not", async () => {
    const run = await ctx.store.trainingRuns.resolve({
      entity: (await openRun()).entity,
      request_id: unique("resolve"),
      fingerprint: "f",
      run_name: null,
      spec: { base_model: "b" },
      initial: { state_key: `training-runs/${unique("r")}/v0/`, version: 0 },
    });
    const saved = `training-runs/${run.id}/v1/`;
    const gone = `training-runs/${run.id}/v2/`;
    await ctx.store.trainingRuns.saveState({
      entity: run.entity,
      run_id: run.id,
      name: "kept",
      spec: run.spec,
      learner_version: 1,
      state_key: saved,
      ttl_ms: 1000,
      overwrite: false,
    });
    const keys = [run.state_key!, saved, gone];
    expect([...(await ctx.store.trainingRuns.referencedLearnerKeys(keys))].sort()).toEqual(
      [run.state_key!, saved].sort(),
    );
    ctx.time += 1001;
    expect([...(await ctx.store.trainingRuns.referencedLearnerKeys(keys))]).toEqual([
      run.state_key!,
    ]);
  });

  it("when a saved state is expired (Tinker's delete), then it reads as gone and its files are no longer named; expiring it again answers false", async () => {
    const run = await openRun();
    const state = await ctx.store.trainingRuns.saveState({
      entity: run.entity,
      run_id: run.id,
      name: "to-delete",
      spec: run.spec,
      learner_version: 0,
      state_key: `training-runs/${run.id}/v0-x/`,
      ttl_ms: null,
      overwrite: false,
    });
    expect(await ctx.store.trainingRuns.expireState("another", state.id)).toBe(false);
    expect(await ctx.store.trainingRuns.expireState(run.entity, state.id)).toBe(true);
    expect(await ctx.store.trainingRuns.getState(run.entity, state.id)).toBeUndefined();
    expect([...(await ctx.store.trainingRuns.referencedLearnerKeys([state.state_key]))]).toEqual(
      [],
    );
    expect(await ctx.store.trainingRuns.expireState(run.entity, state.id)).toBe(false);
  });

  it("when commands race for one sequence id, then exactly one is admitted and the sequence stays gapless", async () => {
    const run = await openRun();
    const outcomes = await Promise.all(
      Array.from({ length: 8 }, () => refusal(ctx.store.trainingRuns.admit(run.id, command(0)))),
    );
    expect(outcomes.filter((o) => o === null)).toHaveLength(1);
    expect(outcomes.filter((o) => o === "sequence_gap")).toHaveLength(7);
    const replay = command(1);
    const ids = await Promise.all(
      Array.from({ length: 4 }, () => ctx.store.trainingRuns.admit(run.id, replay)),
    );
    expect(new Set(ids.map((op) => op.id)).size).toBe(1);
    expect((await ctx.store.trainingRuns.get(run.entity, run.id))?.next_sequence_id).toBe(2);
  });

  it("when the run has its most unfinished operations, then the next is rate limited; other content under a request id is request_id_reused", async () => {
    const run = await openRun();
    for (let i = 0; i < MAX_UNFINISHED_OPERATIONS; i++)
      await ctx.store.trainingRuns.admit(run.id, command(i));
    const err = await ctx.store.trainingRuns
      .admit(run.id, command(MAX_UNFINISHED_OPERATIONS))
      .catch((e: unknown) => e as DomainError);
    expect(err).toMatchObject({ kind: "rate_limited", code: "too_many_unfinished_commands" });
    const first = await ctx.store.trainingRuns.getOperation(run.id, (await opAt(run.id, 0))!);
    await expect(
      ctx.store.trainingRuns.admit(run.id, { ...command(0), request_id: first!.request_id }),
    ).rejects.toBeInstanceOf(ConflictError);
  });

  it("when a worker dies mid-operation, then the next claim fails that operation with execution_failed, and a learner kind fails its run and the operations after it", async () => {
    // Earlier tests' operations would be claimed first: they end here.
    await ctx.store.sql.exec(
      "UPDATE training_operations SET status = 'cancelled' WHERE status IN ('admitted', 'running')",
    );
    const run = await openRun();
    const fb = await ctx.store.trainingRuns.admit(run.id, command(0, "forward_backward"));
    const later = await ctx.store.trainingRuns.admit(run.id, command(1));
    const runs = ctx.store.trainingRuns;
    const worker = unique("dead");
    // A lease that lapsed at once: the worker died holding it.
    expect((await runs.claimRun(worker, -1000))?.id).toBe(run.id);
    expect((await runs.startOperation(worker, fb))?.id).toBe(run.id);
    expect((await runs.claimRun(unique("next"), 60_000))?.id).toBe(run.id);
    const failed = await runs.getOperation(run.id, fb.id);
    expect(failed).toMatchObject({ status: "failed", error_code: "execution_failed" });
    expect((await runs.getOperation(run.id, later.id))?.status).toBe("failed");
    expect((await runs.get(run.entity, run.id))?.status).toBe("failed");
    // Cancelling an ended operation leaves it as it is.
    expect(await runs.cancel(run.id, fb.id)).toEqual(failed);
  });

  async function opAt(runId: string, sequence: number): Promise<string | undefined> {
    const row = await ctx.store.sql.one<{ id: string }>(
      "SELECT id FROM training_operations WHERE run_id = $1 AND sequence_id = $2",
      [runId, sequence],
    );
    return row?.id;
  }
});
