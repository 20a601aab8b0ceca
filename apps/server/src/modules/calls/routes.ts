import { InvalidInputError, type Store } from "@arbor/store";
import type { Handlers } from "../../http/operations.ts";
import { authorizeProject, callToWire, upsertBatch } from "./service.ts";

/** The calls surface (`/call/...`, `/calls/...`, ADR 1): ingestion, query, delete and usage. */
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
    // The validator checked the body but not its items (see items.ts): each is checked there.
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
    getCallsUsageByDay: async ({ body, principal }) => {
      const project = authorizeProject(principal, body.project_id);
      const { start, end } = dayRange(body.start_date, body.end_date);
      const daily_usage = await calls.usageByDay(project, start, end, {
        includeCosts: body.include_costs ?? false,
      });
      return { start_date: start, end_date: end, daily_usage };
    },
  };
}

/** The longest range `getCallsUsageByDay` sums: a year, leap day included. */
const MAX_DAYS = 366;
const DAY_MS = 86_400_000;

/** `[start, end]` as `YYYY-MM-DD`, by default the 30 days to today (UTC). */
function dayRange(startDate?: string, endDate?: string): { start: string; end: string } {
  const day = (ms: number) => new Date(ms).toISOString().slice(0, 10);
  const endMs = endDate ? dayMs(endDate, "end_date") : Date.parse(day(Date.now()));
  const startMs = startDate ? dayMs(startDate, "start_date") : endMs - 29 * DAY_MS;
  if (startMs > endMs)
    throw new InvalidInputError("start_date is after end_date", { param: "start_date" });
  if ((endMs - startMs) / DAY_MS + 1 > MAX_DAYS)
    throw new InvalidInputError(`The range spans more than ${MAX_DAYS} days`, {
      param: "start_date",
    });
  return { start: day(startMs), end: day(endMs) };
}

/** A calendar day's midnight (UTC); `2026-02-30` is no day (the format check lets it by). */
function dayMs(date: string, param: string): number {
  const ms = Date.parse(`${date}T00:00:00Z`);
  if (Number.isNaN(ms) || new Date(ms).toISOString().slice(0, 10) !== date)
    throw new InvalidInputError(`${param} ${JSON.stringify(date)} is not a calendar day`, {
      param,
    });
  return ms;
}
