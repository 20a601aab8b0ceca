import type { components } from "@arbor/spec/schema";
import type { Call, CallBatchItem, CallsRepo } from "@arbor/store";
import { type Principal, projectFor } from "../access.ts";
import { checkBatchItem } from "./items.ts";

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
    inputs: call.inputs ?? {},
    output: call.output,
    exception: call.exception,
    attributes: call.attributes ?? {},
    // Any JSON value, as sent (the spec's CallSummary types the usual object shape).
    summary: (call.summary ?? {}) as Schemas["Call"]["summary"],
  };
}

type BatchResponse = Schemas["CallUpsertBatchResponse"];

/** Where a store error's `param` (`start.started_at`) is in an item's request. */
function locOfParam(index: number, param: string | null): (string | number)[] {
  return ["body", "batch", index, "req", ...(param ? param.split(".") : [])];
}

/**
 * Applies a batch in one transaction and answers per item, in order (ADR 37): each item is
 * checked against the spec on its own, and an item that fails, or that the store refuses (a
 * start that conflicts), is reported in `errors` while every other item is stored. A project
 * the key may not act for refuses the whole request (403), before anything is stored.
 */
export async function upsertBatch(
  calls: CallsRepo,
  principal: Principal,
  batch: unknown[],
): Promise<BatchResponse> {
  const errors: BatchResponse["errors"][] = new Array(batch.length);
  const items: CallBatchItem[] = [];
  const positions: number[] = [];
  for (const [index, raw] of batch.entries()) {
    const checked = checkBatchItem(raw, index);
    if (!checked.ok) {
      errors[index] = checked.issues.map((issue) => ({ index, ...issue }));
      continue;
    }
    const { item } = checked;
    if (item.mode === "start") {
      authorizeProject(principal, item.req.start.project_id);
      items.push({ mode: "start", start: item.req.start });
    } else {
      authorizeProject(principal, item.req.end.project_id);
      items.push({ mode: "end", end: item.req.end });
    }
    positions.push(index);
  }
  const res: BatchResponse["res"] = new Array(batch.length).fill(null);
  const results = items.length > 0 ? await calls.upsertBatch(items) : [];
  for (const [k, result] of results.entries()) {
    const index = positions[k]!;
    if (result.ok) {
      res[index] = "id" in result ? { id: result.id, trace_id: result.trace_id } : {};
    } else {
      const { error } = result;
      errors[index] = [
        {
          index,
          loc: locOfParam(index, error.kind === "conflict" ? "start" : error.param),
          msg: error.message,
          type: error.kind === "conflict" ? "conflict" : "value_error",
        },
      ];
    }
  }
  return { res, errors: errors.flatMap((e) => e ?? []) };
}
