import type { components } from "@arbor/client";
import uPlot from "uplot";
import { alertBox, empty, field, h, mount, num, table } from "../dom.ts";
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
    const models = [...new Set(days.flatMap(([, byModel]) => Object.keys(byModel)))].sort();
    mount(
      out,
      chart(result.start_date, result.end_date, result.daily_usage, models, signal),
      usageTable(days, costs.checked),
    );
  } catch (err) {
    mount(out, alertBox(err));
  }
}

function chart(
  from: string,
  to: string,
  daily: Record<string, Record<string, { total_tokens: number }>>,
  models: string[],
  signal: AbortSignal,
): HTMLElement {
  const xs: number[] = [];
  for (let t = Date.parse(from); t <= Date.parse(to); t += DAY_MS) xs.push(t / 1000);
  const day = (s: number) => new Date(s * 1000).toISOString().slice(0, 10);
  const body = h("div", { class: "plot" });
  const figure = h(
    "figure",
    { class: "chart wide" },
    h("figcaption", null, h("strong", null, "Total tokens per day")),
    body,
  );
  const palette = ["#2f7de1", "#e0672c", "#2a9d5b", "#b04fc6", "#c9a227", "#d04a6a"];
  const stroke =
    getComputedStyle(document.documentElement).getPropertyValue("--fg-muted").trim() || "#666";
  const plot = new uPlot(
    {
      width: 800,
      height: 260,
      axes: [{ stroke }, { stroke }],
      series: [
        { label: "day" },
        ...models.map((m, i) => ({
          label: m,
          stroke: palette[i % palette.length],
          fill: `${palette[i % palette.length]}33`,
          width: 2,
          paths: uPlot.paths.bars!({ size: [0.8 / models.length, 40] }),
          points: { show: false },
        })),
      ],
    },
    [xs, ...models.map((m) => xs.map((x) => daily[day(x)]?.[m]?.total_tokens ?? 0))],
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

type Usage = components["schemas"]["LLMUsage"];

function usageTable(days: [string, Record<string, Usage>][], withCosts: boolean): HTMLElement {
  const heads = ["Day", "Model", "Requests", "Prompt tokens", "Completion tokens", "Total tokens"];
  if (withCosts) heads.push("Cost");
  return h(
    "section",
    { class: "card" },
    table(
      heads,
      days.flatMap(([d, byModel]) =>
        Object.entries(byModel).map(([model, u]) => [
          d,
          h("code", null, model),
          num(u.requests),
          num(u.prompt_tokens),
          num(u.completion_tokens),
          num(u.total_tokens),
          ...(withCosts
            ? [num((u.prompt_tokens_total_cost ?? 0) + (u.completion_tokens_total_cost ?? 0), 4)]
            : []),
        ]),
      ),
      { class: "usage" },
    ),
  );
}
