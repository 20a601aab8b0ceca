import type { Store } from "@arbor/store";
import type { Handlers } from "../../http/operations.ts";
import { authorizeProject, callToWire, upsertBatch } from "./service.ts";

/** The calls surface (CONTRACT §7): ingestion, query, delete and usage. */
export function callsHandlers(store: Store): Handlers {
  const { calls } = store;
  return {
    startCall: async ({ body, principal }) => {
      authorizeProject(principal, body.start.project_id);
      return calls.startCall(body.start);
    },
    endCall: async ({ body, principal }) => {
      authorizeProject(principal, body.end.project_id);
      await calls.endCall(body.end);
      return {};
    },
    upsertCallBatch: ({ body, principal }) => upsertBatch(calls, principal, body.batch),
    queryCalls: async ({ body, principal }) => {
      const project = authorizeProject(principal, body.project_id);
      const limit = body.limit ?? 1000;
      const found = await calls.queryCalls(project, body.filter ?? {}, limit + 1, body.offset ?? 0);
      return { calls: found.slice(0, limit).map(callToWire), has_more: found.length > limit };
    },
    deleteCalls: async ({ body, principal }) => {
      const project = authorizeProject(principal, body.project_id);
      return { num_deleted: await calls.deleteCalls(project, body.call_ids) };
    },
    getCallsUsage: async ({ body, principal }) => {
      const project = authorizeProject(principal, body.project_id);
      return calls.callUsage(project, body.call_ids, {
        includeCosts: body.include_costs ?? false,
        limit: body.limit ?? 10000,
      });
    },
  };
}
