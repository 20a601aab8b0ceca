import { randomUUID } from "node:crypto";
import { beforeAll, describe, expect, it } from "vitest";
import type { RunningServer } from "./harness.ts";
import { adam, RunClient, TrainingRuns } from "./native-runs/client.ts";
import {
  CROSS_ENTROPY,
  nativeServer,
  requestId,
  reversalBatch,
  SPEC,
} from "./native-runs/fixtures.ts";
import { STORES } from "./pg.ts";

/**
 * Arbor's reading of native runs (ADR 64): the runs of the key's entities and each run's
 * operations with what they measured, which the console draws. Runs are driven through the
 * ART-style client (native-runs/), read through @arbor/client's raw GET, on both stores.
 */
describe.each(STORES)("native runs' progress on $name", (store) => {
  const native = nativeServer(store);
  let server: RunningServer;
  beforeAll(() => {
    if (store.skip !== null) return;
    server = native.server();
  });
  const test = it.skipIf(store.skip !== null);

  /** A new tenant, its ART-style client and its @arbor/client. */
  const tenant = async () => {
    const t = await server.newTenant(`runs-${randomUUID().slice(0, 8)}`);
    return { ...t, runs: new TrainingRuns(server.baseUrl, t.apiKey) };
  };

  describe("listTrainingRuns", () => {
    test("when a tenant lists its runs, then they come newest first, paged by after, filtered by status, and no other tenant's", async () => {
      const a = await tenant();
      const opened = [];
      for (let i = 0; i < 3; i++)
        opened.push(
          await RunClient.resolve(a.runs, { requestId: requestId("resolve"), spec: SPEC }),
        );
      const closed = await opened[0]!.close();
      expect(closed.status).toBe("closed");
      const newest = [...opened].reverse().map((r) => r.runId);

      const first = await a.client.GET("/v1/training/runs", { params: { query: { limit: 2 } } });
      expect(first.response.status).toBe(200);
      expect(first.data).toEqual({
        object: "list",
        data: [await a.runs.get(newest[0]!), await a.runs.get(newest[1]!)],
        first_id: newest[0],
        last_id: newest[1],
        has_more: true,
      });
      const second = await a.client.GET("/v1/training/runs", {
        params: { query: { limit: 2, after: first.data!.last_id! } },
      });
      expect(second.data).toEqual({
        object: "list",
        data: [closed],
        first_id: newest[2],
        last_id: newest[2],
        has_more: false,
      });
      const onlyClosed = await a.client.GET("/v1/training/runs", {
        params: { query: { status: "closed" } },
      });
      expect(onlyClosed.data!.data).toEqual([closed]);
      expect(
        (await a.client.training.runs.list({ status: "open" }).then((p) => p.data)).map(
          (r) => r.run_id,
        ),
      ).toEqual(newest.slice(0, 2));

      const b = await tenant();
      const theirs = await b.client.GET("/v1/training/runs", {});
      expect(theirs.data).toEqual({
        object: "list",
        data: [],
        first_id: null,
        last_id: null,
        has_more: false,
      });
    });

    test("when status is not a run's status, then 400 with the whole envelope", async () => {
      const a = await tenant();
      const bad = await a.client.GET("/v1/training/runs", {
        params: { query: { status: "running" as never } },
      });
      expect(bad.response.status).toBe(400);
      expect(bad.error).toEqual({
        error: {
          message:
            "status: must be equal to one of the allowed values: open, closing, closed, failed",
          type: "invalid_request_error",
          param: "status",
          code: null,
        },
      });
    });
  });

  describe("listTrainingOperations", () => {
    test("when a run took two SFT steps and released their results, then its operations list in sequence order with loss, tokens and learner version", async () => {
      const a = await tenant();
      const run = await RunClient.resolve(a.runs, { requestId: requestId("resolve"), spec: SPEC });
      const measured: { loss: number; tokens: number }[] = [];
      for (const word of ["cat", "dog"]) {
        const fb = await run.forwardBackward({
          requestId: requestId("fb"),
          batch: await reversalBatch([word]),
          loss: CROSS_ENTROPY,
          returnTokenLogprobs: false,
        });
        const result = await fb.result();
        measured.push({
          loss: result.loss.value,
          tokens: result.training.accepted_trainable_tokens,
        });
        await fb.releaseResult(requestId("release"));
        const step = await run.optimStep(requestId("optim"), adam(1e-2));
        await step.result();
      }
      const page = await a.client.GET("/v1/training/runs/{run_id}/operations", {
        params: { path: { run_id: run.runId } },
      });
      expect(page.response.status).toBe(200);
      const records = await Promise.all(
        page.data!.data.map((p) => a.runs.operation(run.runId, p.operation.operation_id)),
      );
      expect(records.map((r) => [r.sequence_id, r.kind, r.status])).toEqual([
        [0, "forward_backward", "succeeded"],
        [1, "optim_step", "succeeded"],
        [2, "forward_backward", "succeeded"],
        [3, "optim_step", "succeeded"],
      ]);
      // The forward_backwards' results are released; what they measured stays listed.
      expect(records[0]!.result_ref).toBeNull();
      expect(page.data).toEqual({
        object: "list",
        data: [
          { operation: records[0], ...measured[0], learner_version: 0 },
          { operation: records[1], loss: null, tokens: null, learner_version: 1 },
          { operation: records[2], ...measured[1], learner_version: 1 },
          { operation: records[3], loss: null, tokens: null, learner_version: 2 },
        ],
        first_id: records[0]!.operation_id,
        last_id: records[3]!.operation_id,
        has_more: false,
      });
      expect(measured[0]!.tokens).toBeGreaterThan(0);

      const paged = await a.client.GET("/v1/training/runs/{run_id}/operations", {
        params: {
          path: { run_id: run.runId },
          query: { limit: 3, after: records[0]!.operation_id },
        },
      });
      expect(paged.data!.data.map((p) => p.operation.sequence_id)).toEqual([1, 2, 3]);
      expect(paged.data!.has_more).toBe(false);
    });

    test("when another tenant's run or an unknown run is listed, then 404 training_run_not_found with the whole envelope", async () => {
      const a = await tenant();
      const run = await RunClient.resolve(a.runs, { requestId: requestId("resolve"), spec: SPEC });
      const b = await tenant();
      for (const runId of [run.runId, randomUUID()]) {
        const res = await b.client.GET("/v1/training/runs/{run_id}/operations", {
          params: { path: { run_id: runId } },
        });
        expect(res.response.status).toBe(404);
        expect(res.error).toEqual({
          error: {
            message: `Training run "${runId}" not found.`,
            type: "not_found_error",
            param: null,
            code: "training_run_not_found",
          },
        });
      }
    });
  });
});
