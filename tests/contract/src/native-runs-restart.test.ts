import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import {
  adam,
  forwardBody,
  RemoteOperation,
  RunClient,
  TrainingRuns,
} from "./native-runs/client.ts";
import { CROSS_ENTROPY, requestId, reversalBatch, SPEC, sftStep } from "./native-runs/fixtures.ts";
import { type Child, startServerProcess } from "./processes.ts";

/** The native training API (ADR 57) across a restart of the server process, on one store. */
const dataDir = mkdtempSync(join(tmpdir(), "arbor-native-restart-"));
let child: Child | undefined;

async function start(): Promise<TrainingRuns> {
  const started = await startServerProcess(dataDir);
  child = started.child;
  return new TrainingRuns(`http://127.0.0.1:${started.port}`, started.apiKey);
}

afterAll(async () => {
  await child?.kill9();
  rmSync(dataDir, { recursive: true, force: true });
});

describe("retrieveTrainingOperation", () => {
  it("when the server restarts, then its runs, operations, results and open gradients are as they were, a replay answers the same operation, and the run goes on", async () => {
    let runs = await start();
    const run = await RunClient.resolve(runs, { requestId: requestId("resolve"), spec: SPEC });
    const batch = await reversalBatch(["cat", "dog"]);
    expect((await sftStep(run, batch)).optimizer.learner_version).toBe(1);
    // A forward_backward that succeeded and is still open: its gradient waits for an optim_step.
    const body = forwardBody(2, {
      requestId: requestId("fb"),
      batch,
      loss: CROSS_ENTROPY,
      returnTokenLogprobs: false,
    });
    const admitted = await runs.submit(run.runId, { kind: "forward_backward", body });
    const result = await new RemoteOperation<"forward_backward">(runs, admitted).result();
    const before = {
      run: await runs.get(run.runId),
      operation: await runs.operation(run.runId, admitted.operation_id),
    };
    expect(before.run).toMatchObject({ next_sequence_id: 3, committed_learner_version: 1 });

    expect(await child!.terminate()).toBe(0);
    runs = await start();

    expect(await runs.get(run.runId)).toEqual(before.run);
    expect(await runs.operation(run.runId, admitted.operation_id)).toEqual(before.operation);
    expect(await runs.result(run.runId, admitted.operation_id)).toEqual(result);
    const replay = await runs.submit(run.runId, { kind: "forward_backward", body });
    expect(replay.operation_id).toBe(admitted.operation_id);
    const resumed = new RunClient(runs, await runs.get(run.runId));
    const step = await (await resumed.optimStep(requestId("optim"), adam(1e-2))).result();
    expect(step.contributing_operation_ids).toEqual([admitted.operation_id]);
    expect(step.learner_version).toBe(2);
    expect((await runs.get(run.runId)).committed_learner_version).toBe(2);
  });
});
