import type { components } from "@arbor/client";
import uPlot from "uplot";
import { alertBox, empty, field, h, mount, num, table } from "../dom.ts";
import { bucketFor, bucketStart, groupedModels, tickLabels } from "../format.ts";
import type { PageContext } from "../main.ts";
import { api } from "../session.ts";
import { all } from "./models.ts";

const DAY_MS = 86_400_000;

/** Tokens and costs by model and by day for a project, summed by the server from stored calls. */
export async function usagePage({ root, query, signal }: PageContext): Promise<void> {
  const client = api();
  const today = new Date().toISOString().slice(0, 10);
  let project = query.get("project");
  if (!project) {
    // Chats are recorded in `<entity>/inference` unless the client names a project.
    const models = await all(client.training.models.list(), 1);
    const entity =
      models[0]?.entity ??
      (await all(client.models.list())).find((m) => m.parent !== null)?.owned_by;
    project = `${entity ?? "default"}/inference`;
  }
  const projectInput = h("input", {
    name: "project",
    required: true,
    value: project,
    // Browsers compile `pattern` with the `v` flag: `/` is escaped inside and outside a class.
    pattern: "[^\\/]+\\/[^\\/]+",
    title: "entity/project",
  });
  const start = h("input", {
    type: "date",
    name: "start_date",
    value: query.get("start") ?? new Date(Date.now() - 29 * DAY_MS).toISOString().slice(0, 10),
  });
  const end = h("input", { type: "date", name: "end_date", value: query.get("end") ?? today });
  const costs = h("input", {
    type: "checkbox",
    name: "include_costs",
    checked: query.get("costs") === "1",
  });
  const out = h("div", { "aria-live": "polite" });
  mount(
    root,
    h("h1", null, "Usage"),
    h(
      "form",
      {
        class: "card row wrap",
        "aria-label": "Usage range",
        onsubmit: (event: Event) => {
          event.preventDefault();
          const q = new URLSearchParams({
            project: projectInput.value,
            start: start.value,
            end: end.value,
          });
          if (costs.checked) q.set("costs", "1");
          location.hash = `#/usage?${q}`;
        },
      },
      field("Project", projectInput, "entity/project of the calls"),
      field("From", start),
      field("To", end),
      h("label", { class: "check" }, costs, " Costs"),
      h("button", { type: "submit", class: "primary" }, "Show"),
    ),
    out,
  );
  try {
    const result = await client.calls.usageByDay({
      project_id: project,
      start_date: start.value,
      end_date: end.value,
      include_costs: costs.checked,
    });
    const days = Object.entries(result.daily_usage);
    if (days.length === 0) {
      mount(
        out,
        empty(`No usage in ${project} between ${result.start_date} and ${result.end_date}.`),
      );
      return;
    }
    const groups = groupedModels(new Set(days.flatMap(([, byModel]) => Object.keys(byModel))));
    mount(
      out,
      chart(result.start_date, result.end_date, result.daily_usage, groups, signal),
      usageTable(days, groups, costs.checked),
    );
  } catch (err) {
    mount(out, alertBox(err));
  }
}

type Usage = components["schemas"]["LLMUsage"];
type Group = ReturnType<typeof groupedModels>[number];

/** Tokens per bucket (day, week or month, by the range's length), one bar per model with its
 * checkpoints summed in: 30 days are a handful of weekly bars, not one line. */
function chart(
  from: string,
  to: string,
  daily: Record<string, Record<string, { total_tokens: number }>>,
  groups: Group[],
  signal: AbortSignal,
): HTMLElement {
  const days = Math.round((Date.parse(to) - Date.parse(from)) / DAY_MS) + 1;
  const bucket = bucketFor(days);
  const starts: string[] = [];
  for (let t = Date.parse(from); t <= Date.parse(to); t += DAY_MS) {
    const start = bucketStart(new Date(t).toISOString().slice(0, 10), bucket);
    if (starts.at(-1) !== start) starts.push(start);
  }
  const index = new Map(starts.map((s, i) => [s, i]));
  const totals = groups.map(() => starts.map(() => 0));
  for (const [day, byModel] of Object.entries(daily)) {
    const i = index.get(bucketStart(day, bucket));
    if (i === undefined) continue;
    groups.forEach((g, gi) => {
      for (const id of g.ids) totals[gi]![i]! += byModel[id]?.total_tokens ?? 0;
    });
  }
  const xs = starts.map((_, i) => i);
  const label = (i: number) => {
    const start = starts[i];
    if (start === undefined) return "";
    return bucket.name === "month" ? start.slice(0, 7) : start.slice(5);
  };
  const body = h("div", { class: "plot" });
  const figure = h(
    "figure",
    { class: "chart wide", "data-bucket": bucket.name, "data-buckets": String(starts.length) },
    h("figcaption", null, h("strong", null, `Total tokens per ${bucket.name}`)),
    body,
  );
  const palette = ["#2f7de1", "#e0672c", "#2a9d5b", "#b04fc6", "#c9a227", "#d04a6a"];
  const stroke =
    getComputedStyle(document.documentElement).getPropertyValue("--fg-muted").trim() || "#666";
  const plot = new uPlot(
    {
      width: 800,
      height: 260,
      scales: { x: { time: false, range: [-0.5, Math.max(0.5, starts.length - 0.5)] } },
      axes: [
        {
          stroke,
          splits: () => xs,
          values: (_u: uPlot, splits: number[]) => splits.map(label),
        },
        { stroke, values: (_u: uPlot, splits: number[]) => tickLabels(splits), size: 60 },
      ],
      series: [
        {
          label: bucket.name,
          value: (_u: uPlot, v: number | null) => (v === null ? "" : label(v)),
        },
        ...groups.map((g, i) => ({
          label: g.ids.length > 1 ? `${g.model} (+${g.ids.length - 1} checkpoints)` : g.model,
          stroke: palette[i % palette.length],
          fill: `${palette[i % palette.length]}33`,
          width: 2,
          paths: uPlot.paths.bars!({ size: [0.8 / Math.max(1, groups.length), 60] }),
          points: { show: false },
        })),
      ],
    },
    [xs, ...totals],
    body,
  );
  const resize = new ResizeObserver(() =>
    plot.setSize({ width: Math.max(300, body.clientWidth), height: 260 }),
  );
  resize.observe(body);
  signal.addEventListener("abort", () => {
    resize.disconnect();
    plot.destroy();
  });
  return figure;
}

/** The range's totals: each model, then its checkpoints beneath it, by step. */
function usageTable(
  days: [string, Record<string, Usage>][],
  groups: Group[],
  withCosts: boolean,
): HTMLElement {
  const sums = new Map<string, Usage>();
  for (const [, byModel] of days)
    for (const [id, u] of Object.entries(byModel)) {
      const s = sums.get(id);
      sums.set(id, s ? add(s, u) : { ...u });
    }
  const heads = ["Model", "Requests", "Prompt tokens", "Completion tokens", "Total tokens"];
  if (withCosts) heads.push("Cost");
  const cells = (u: Usage) => [
    num(u.requests),
    num(u.prompt_tokens),
    num(u.completion_tokens),
    num(u.total_tokens),
    // No price for the model: no cost, rather than a cost of 0.
    ...(withCosts ? [cost(u)] : []),
  ];
  const rows = groups.flatMap((g) => {
    const members = g.ids.map((id) => sums.get(id)!);
    const total = members.reduce((a, b) => add(a, b));
    const head = [h("td", { class: "model" }, h("code", null, g.model)), ...cells(total)];
    // Only the model itself: one row. Its checkpoints: a row each beneath it, by step.
    if (g.ids.length === 1 && g.ids[0] === g.model) return [head];
    return [
      head,
      ...g.ids.map((id, i) => [
        h(
          "td",
          { class: "checkpoint" },
          h("code", null, id === g.model ? "latest" : id.slice(g.model.length + 1)),
        ),
        ...cells(members[i]!),
      ]),
    ];
  });
  return h(
    "section",
    { class: "card" },
    h("h2", null, "By model"),
    table(heads, rows, { class: "usage" }),
  );
}

/** "—" where no price applies. The usage API (Weave's shape) answers 0 for a model with no
 * price in effect as for one priced at 0; the console cannot tell them apart, and shows a
 * total of 0 as "—" (nothing to pay) rather than a figure that looks like a priced one. */
function cost(u: Usage): string {
  const parts = [
    u.prompt_tokens_total_cost,
    u.completion_tokens_total_cost,
    u.cache_read_input_tokens_total_cost,
    u.cache_creation_input_tokens_total_cost,
  ].filter((c): c is number => c !== null && c !== undefined);
  const total = parts.reduce((a, b) => a + b, 0);
  if (total === 0) return "—";
  return `$${total.toFixed(4)}`;
}

function add(a: Usage, b: Usage): Usage {
  const c = (x: number | null, y: number | null) =>
    x === null && y === null ? null : (x ?? 0) + (y ?? 0);
  return {
    requests: a.requests + b.requests,
    prompt_tokens: a.prompt_tokens + b.prompt_tokens,
    completion_tokens: a.completion_tokens + b.completion_tokens,
    total_tokens: a.total_tokens + b.total_tokens,
    cache_read_input_tokens: a.cache_read_input_tokens + b.cache_read_input_tokens,
    cache_creation_input_tokens: a.cache_creation_input_tokens + b.cache_creation_input_tokens,
    prompt_tokens_total_cost: c(a.prompt_tokens_total_cost, b.prompt_tokens_total_cost),
    completion_tokens_total_cost: c(a.completion_tokens_total_cost, b.completion_tokens_total_cost),
    cache_read_input_tokens_total_cost: c(
      a.cache_read_input_tokens_total_cost,
      b.cache_read_input_tokens_total_cost,
    ),
    cache_creation_input_tokens_total_cost: c(
      a.cache_creation_input_tokens_total_cost,
      b.cache_creation_input_tokens_total_cost,
    ),
  };
}
