import type { TrainingOperationProgress, TrainingRun } from "@arbor/client";
import { chartControls, type Line, MetricChart } from "../chart.ts";
import { empty, field, h, mount, num, pagedList, table } from "../dom.ts";
import type { PageContext } from "../main.ts";
import { api } from "../session.ts";
import { all } from "./models.ts";

const STATUSES = ["", "open", "closing", "closed", "failed"] as const;
type RunStatus = TrainingRun["status"];

/** How often an open run's page reads its operations again. */
const POLL_MS = 1000;

function runLabel(run: TrainingRun): string {
  return run.run_name ?? run.run_id.slice(0, 13);
}

/** The key's native training runs (ADR 57), newest first, filtered by status, a page at a time. */
export async function runsPage({ root, query }: PageContext): Promise<void> {
  const client = api();
  const status = h(
    "select",
    { name: "status" },
    STATUSES.map((s) =>
      h("option", { value: s, selected: (query.get("status") ?? "") === s }, s || "Any status"),
    ),
  );
  status.addEventListener("change", () => {
    location.hash = `#/runs${status.value ? `?status=${status.value}` : ""}`;
  });
  const results = h("div");
  const more = h("button", { hidden: true }, "Load more");
  mount(
    root,
    h("h1", null, "Training runs"),
    h(
      "p",
      { class: "subtle" },
      "Runs that clients such as OpenPipe ART drive through the native training API: each is a " +
        "sequence of operations (forward_backward, optim_step, publications) on one learner.",
    ),
    h("div", { class: "row wrap" }, field("Status", status)),
    h("section", { class: "card" }, results, more),
  );
  const page = await client.training.runs.list({
    limit: 20,
    ...(query.get("status") ? { status: query.get("status") as RunStatus } : {}),
  });
  pagedList(page, results, more, (shown) => runsTable(shown));
}

function runsTable(runs: TrainingRun[]): HTMLElement {
  if (runs.length === 0) return empty("No training runs yet.");
  return table(
    ["Run", "Base model", "Status", "Learner version", "Operations"],
    runs.map((r) => [
      h("a", { href: `#/runs/${r.run_id}` }, h("code", null, runLabel(r))),
      r.spec.base_model,
      h("span", { class: `status ${r.status}` }, r.status),
      String(r.committed_learner_version),
      String(r.next_sequence_id),
    ]),
    { class: "runs" },
  );
}

/** The curves of a run: one point per forward_backward, over its sequence id. */
const CURVES: [key: "loss" | "tokens", title: string][] = [
  ["loss", "Loss"],
  ["tokens", "Tokens"],
];

/** A run: its spec and learner versions, the curves of its forward_backwards, and every
 * operation with its status, loss, tokens and learner version; read again while it is open. */
export async function runPage({ root, params, signal }: PageContext): Promise<void> {
  const client = api();
  const runId = params[0]!;
  const lines = new Map<string, Line>(
    CURVES.map(([key]) => [
      key,
      { label: "forward_backward", values: new Map(), marks: new Set() },
    ]),
  );
  const charts = CURVES.map(
    ([key, title]) => new MetricChart(title, [lines.get(key)!], "operation"),
  );
  signal.addEventListener("abort", () => {
    for (const c of charts) c.destroy();
  });
  const summary = h("section", { class: "card", "aria-live": "polite" });
  const operations = h("div");
  let run = await client.training.runs.retrieve(runId);
  mount(
    root,
    h("h1", null, "Training run", " ", h("code", { class: "subtle" }, run.run_id)),
    summary,
    h(
      "section",
      { class: "card" },
      h("h2", null, "Curves"),
      chartControls(charts),
      h(
        "div",
        { class: "charts" },
        charts.map((c) => c.element),
      ),
    ),
    h("section", { class: "card" }, h("h2", null, "Operations"), operations),
  );

  for (;;) {
    const ops = await all(client.training.runs.operations(runId, { limit: 100 }), 100_000);
    if (signal.aborted) return;
    mount(summary, runSummary(run, ops));
    mount(operations, operationsTable(ops));
    for (const { operation, loss, tokens } of ops) {
      if (operation.kind !== "forward_backward" || operation.status !== "succeeded") continue;
      if (loss !== null) lines.get("loss")!.values.set(operation.sequence_id, loss);
      if (tokens !== null) lines.get("tokens")!.values.set(operation.sequence_id, tokens);
    }
    // A checkpoint mark on the last forward_backward before each published learner version.
    let lastForwardBackward: number | null = null;
    for (const { operation } of ops) {
      if (operation.kind === "forward_backward" && operation.status === "succeeded")
        lastForwardBackward = operation.sequence_id;
      if (
        operation.kind === "save_weights_for_sampler" &&
        operation.status === "succeeded" &&
        lastForwardBackward !== null
      )
        for (const line of lines.values()) line.marks!.add(lastForwardBackward);
    }
    for (const c of charts) c.update();
    const unfinished = ops.some(
      (o) => o.operation.status === "admitted" || o.operation.status === "running",
    );
    if (run.status !== "open" && run.status !== "closing" && !unfinished) return;
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
    if (signal.aborted) return;
    run = await client.training.runs.retrieve(runId);
  }
}

function runSummary(run: TrainingRun, ops: TrainingOperationProgress[]): HTMLElement {
  const last = <K extends "loss" | "tokens">(key: K) =>
    ops.findLast((o) => o.operation.kind === "forward_backward" && o[key] !== null)?.[key] ?? null;
  const rows: [string, Node | string][] = [
    ["Status", h("span", { class: `status ${run.status}` }, run.status)],
    ["Name", run.run_name ?? "—"],
    ["Base model", run.spec.base_model],
    ["LoRA", `rank ${run.spec.lora_rank} on ${run.spec.lora_target_modules.join(", ")}`],
    [
      "Learner version",
      `${run.committed_learner_version} committed, ${run.projected_learner_version} projected`,
    ],
    ["Operations", String(run.next_sequence_id)],
    ["Last loss", num(last("loss"))],
    [
      "Tokens trained",
      num(
        ops.reduce(
          (n, o) => n + (o.operation.kind === "forward_backward" ? (o.tokens ?? 0) : 0),
          0,
        ),
      ),
    ],
  ];
  return h(
    "dl",
    { class: "grid" },
    rows.map(([k, v]) => [h("dt", null, k), h("dd", null, v)]),
  );
}

function operationsTable(ops: TrainingOperationProgress[]): HTMLElement {
  if (ops.length === 0) return empty("No operations yet.");
  const seconds = (o: TrainingOperationProgress["operation"]) =>
    o.started_at && o.ended_at
      ? `${((Date.parse(o.ended_at) - Date.parse(o.started_at)) / 1000).toFixed(2)} s`
      : "—";
  return table(
    ["#", "Kind", "Status", "Loss", "Tokens", "Learner version", "Took"],
    ops.map(({ operation: o, loss, tokens, learner_version }) => [
      String(o.sequence_id),
      h("code", null, o.kind),
      h(
        "span",
        { class: `status ${o.status}`, title: o.error ? `error: ${o.error.code}` : undefined },
        o.status,
        o.error && o.status !== "cancelled" ? ` (${o.error.code})` : null,
      ),
      num(loss),
      num(tokens),
      String(learner_version),
      seconds(o),
    ]),
    { class: "operations" },
  );
}
