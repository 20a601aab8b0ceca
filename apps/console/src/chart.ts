import uPlot from "uplot";
import { h } from "./dom.ts";

/** One line per job (or run): its values by gradient step (x), or by another x. */
export interface Line {
  label: string;
  values: Map<number, number>;
  /** Steps to mark with a point on this line (checkpoints). */
  marks?: Set<number>;
}

const PALETTE = ["#2f7de1", "#e0672c", "#2a9d5b", "#b04fc6"];

function cssVar(name: string, fallback: string): string {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || fallback;
}

/**
 * A live uPlot chart of one metric over gradient steps, for one or more jobs; checkpoints are
 * a points-only series on the first line. `update()` redraws after values were added.
 */
export class MetricChart {
  readonly element: HTMLElement;
  readonly #lines: Line[];
  readonly #plot: uPlot;
  readonly #count: HTMLElement;

  /** `x` names the x axis: a job's `step`, a run's `operation` (its sequence id). */
  constructor(title: string, lines: Line[], x = "step") {
    this.#lines = lines;
    const body = h("div", { class: "plot" });
    this.#count = h("span", { class: "subtle", "data-points": "0" }, "no points yet");
    this.element = h(
      "figure",
      { class: "chart", "data-metric": title },
      h("figcaption", null, h("strong", null, title), " ", this.#count),
      body,
    );
    const axis = {
      stroke: cssVar("--fg-muted", "#666"),
      grid: { stroke: cssVar("--grid", "#8884"), width: 1 },
      ticks: { stroke: cssVar("--grid", "#8884"), width: 1 },
    };
    this.#plot = new uPlot(
      {
        width: 480,
        height: 220,
        scales: { x: { time: false } },
        axes: [{ ...axis, label: x }, axis],
        legend: { live: true },
        series: [
          { label: x },
          ...lines.map((line, i) => ({
            label: line.label,
            stroke: PALETTE[i % PALETTE.length],
            width: 2,
            spanGaps: true,
            points: { show: false },
          })),
          {
            label: "checkpoint",
            stroke: cssVar("--fg", "#222"),
            fill: cssVar("--bg", "#fff"),
            paths: () => null,
            points: { show: true, size: 9, width: 2 },
          },
        ],
      },
      [[], ...lines.map(() => []), []],
      body,
    );
    new ResizeObserver(() => {
      const width = Math.max(240, body.clientWidth);
      if (width !== this.#plot.width) this.#plot.setSize({ width, height: 220 });
    }).observe(body);
  }

  update(): void {
    const steps = [...new Set(this.#lines.flatMap((l) => [...l.values.keys()]))].sort(
      (a, b) => a - b,
    );
    const first = this.#lines[0]!;
    const data = [
      steps,
      ...this.#lines.map((l) => steps.map((s) => l.values.get(s) ?? null)),
      steps.map((s) => (first.marks?.has(s) ? (first.values.get(s) ?? null) : null)),
    ] as uPlot.AlignedData;
    this.#plot.setData(data);
    const points = this.#lines.reduce((n, l) => n + l.values.size, 0);
    this.#count.dataset.points = String(points);
    this.#count.textContent = points === 1 ? "1 point" : `${points} points`;
  }

  destroy(): void {
    this.#plot.destroy();
  }
}
