import type { components } from "@arbor/spec/schema";
import type { Call, CallBatchItem, CallsRepo, Json } from "@arbor/store";
import { type Principal, projectFor } from "../access.ts";

type Schemas = components["schemas"];

/** Calls live under `<entity>/<project>`; the key must be a member of the entity (else 403).
 * Every store query is scoped by the project, so another project's ids read as missing. */
export function authorizeProject(principal: Principal, projectId: string): string {
  return projectFor(principal, projectId, "project_id").id;
}

/** The wire shape of a stored call (the tombstone stays internal). */
export function callToWire(call: Call): Schemas["Call"] {
  return {
    id: call.id,
    project_id: call.project_id,
    trace_id: call.trace_id,
    parent_id: call.parent_id,
    op_name: call.op_name,
    display_name: call.display_name,
    started_at: call.started_at,
    ended_at: call.ended_at,
    inputs: asObject(call.inputs),
    output: call.output,
    exception: call.exception,
    attributes: asObject(call.attributes),
    summary: asObject(call.summary),
  };
}

function asObject(value: Json): Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value) ? value : {};
}

type BatchItem = Schemas["CallUpsertBatchRequest"]["batch"][number];

/** Applies a batch in one transaction; answers one entry per item, in order. */
export async function upsertBatch(calls: CallsRepo, principal: Principal, batch: BatchItem[]) {
  const items: CallBatchItem[] = batch.map((item) => {
    if (item.mode === "start") {
      const start = (item.req as Schemas["CallStartRequest"]).start;
      authorizeProject(principal, start.project_id);
      return { mode: "start", start };
    }
    const end = (item.req as Schemas["CallEndRequest"]).end;
    authorizeProject(principal, end.project_id);
    return { mode: "end", end };
  });
  const started = await calls.upsertBatch(items);
  let next = 0;
  return {
    res: items.map((item) => (item.mode === "start" ? started[next++]! : {})),
  };
}
