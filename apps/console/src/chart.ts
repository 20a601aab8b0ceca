import uPlot from "uplot";
import { h } from "./dom.ts";
import { ema, tickLabels } from "./format.ts";

/** One line per job (or run): its values by gradient step (x), or by another x. */
export interface Line {
  label: string;
  values: Map<number, number>;
  /** Steps to mark with a point on this line (checkpoints). */
  marks?: Set<number>;
  /**
   * A validation curve: a few points (each an evaluation of a whole held-out set), drawn dashed
   * with its points, in the validation colours, and never smoothed.
   */
  validation?: boolean;
}

/** How every chart of a page draws: EMA smoothing weight (0: none) and a log y scale. */
export interface ChartView {
  smoothing: number;
  log: boolean;
}

const PALETTE = ["#2f7de1", "#e0672c", "#2a9d5b", "#b04fc6"];
/** Validation curves' colours: apart from the training lines', the first job's first. */
const VALIDATION_PALETTE = ["#d6336c", "#9c7a00"];
const HEIGHT = 220;

function cssVar(name: string, fallback: string): string {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || fallback;
}

/** An axis as wide as its longest label, so that no label is clipped (`10,000`, not `0,000`). */
function fitLabels(self: uPlot, values: string[] | null, axisIdx: number, cycle: number): number {
  const axis = self.axes[axisIdx]!;
  if (cycle > 1) return (axis as { _size?: number })._size ?? 50;
  let size = (axis.ticks?.size ?? 10) + (axis.gap ?? 5) + 8;
  const longest = (values ?? []).reduce((a, v) => (v.length > a.length ? v : a), "");
  if (longest) {
    self.ctx.font = (axis.font as unknown as [string])?.[0] ?? self.ctx.font;
    size += self.ctx.measureText(longest).width / devicePixelRatio;
  }
  return Math.ceil(size);
}

/**
 * A live uPlot chart of one metric over gradient steps, for one or more jobs (and their
 * validation curves); checkpoints are a points-only series on the first line. `update()` redraws after values were added; `view()`
 * smooths (the raw line stays, faint) or switches to a log scale. Drag across a chart to zoom
 * into those steps; a double click zooms out.
 */
export class MetricChart {
  readonly element: HTMLElement;
  readonly #lines: Line[];
  readonly #x: string;
  readonly #body: HTMLElement;
  readonly #count: HTMLElement;
  readonly #reset: HTMLButtonElement;
  #view: ChartView = { smoothing: 0, log: false };
  /** The x range dragged to, kept while new points arrive and across a change of view. */
  #zoom: { min: number; max: number } | null = null;
  #plot: uPlot;

  /** `x` names the x axis: a job's `step`, a run's `operation` (its sequence id). */
  constructor(title: string, lines: Line[], x = "step") {
    this.#lines = lines;
    this.#x = x;
    this.#body = h("div", { class: "plot" });
    this.#count = h("span", { class: "subtle", "data-points": "0" }, "no points yet");
    this.#reset = h(
      "button",
      { type: "button", class: "small", hidden: true, "aria-label": `Reset zoom of ${title}` },
      "Reset zoom",
    );
    this.#reset.addEventListener("click", () => this.#unzoom());
    this.element = h(
      "figure",
      { class: "chart", "data-metric": title },
      h("figcaption", null, h("strong", null, title), " ", this.#count, " ", this.#reset),
      this.#body,
    );
    this.#plot = this.#build();
    new ResizeObserver(() => {
      const width = Math.max(240, this.#body.clientWidth);
      if (width !== this.#plot.width) this.#plot.setSize({ width, height: HEIGHT });
    }).observe(this.#body);
  }

  #build(): uPlot {
    const axis = {
      stroke: cssVar("--fg-muted", "#666"),
      grid: { stroke: cssVar("--grid", "#8884"), width: 1 },
      ticks: { stroke: cssVar("--grid", "#8884"), width: 1 },
      values: (_u: uPlot, splits: number[]) => tickLabels(splits),
      size: fitLabels,
    };
    const smooth = this.#view.smoothing > 0;
    const series: uPlot.Series[] = [{ label: this.#x }];
    let trained = 0;
    let validated = 0;
    this.#lines.forEach((line) => {
      if (line.validation) {
        series.push({
          label: line.label,
          stroke: VALIDATION_PALETTE[validated++ % VALIDATION_PALETTE.length]!,
          width: 2,
          dash: [6, 4],
          spanGaps: true,
          points: { show: true, size: 7 },
        });
        return;
      }
      const color = PALETTE[trained++ % PALETTE.length]!;
      series.push({
        label: smooth ? `${line.label} (smoothed)` : line.label,
        stroke: color,
        width: 2,
        spanGaps: true,
        points: { show: false },
      });
      if (smooth)
        series.push({
          label: `${line.label} (raw)`,
          stroke: `${color}40`,
          width: 1,
          spanGaps: true,
          points: { show: false },
        });
    });
    series.push({
      label: "checkpoint",
      stroke: cssVar("--fg", "#222"),
      fill: cssVar("--bg", "#fff"),
      paths: () => null,
      points: { show: true, size: 9, width: 2 },
    });
    return new uPlot(
      {
        width: Math.max(240, this.#body.clientWidth || 480),
        height: HEIGHT,
        scales: {
          x: { time: false },
          y: this.#view.log ? { distr: 3, log: 10 } : { distr: 1 },
        },
        axes: [{ ...axis, label: this.#x }, axis],
        legend: { live: true },
        cursor: { drag: { x: true, y: false } },
        hooks: { setScale: [(u, key) => key === "x" && this.#zoomed(u)] },
        series,
      },
      this.#data(),
      this.#body,
    );
  }

  /** After the x scale changed: a drag (narrower than the data) zooms, a double click (the
   * whole range again) zooms out. The range shows as `data-zoom` and a Reset button. */
  #zoomed(u: uPlot): void {
    const xs = u.data[0];
    const { min, max } = u.scales.x!;
    const narrower =
      xs.length > 1 &&
      min !== undefined &&
      max !== undefined &&
      (min > xs[0]! || max < xs[xs.length - 1]!);
    this.#zoom = narrower ? { min: min!, max: max! } : null;
    this.#reset.hidden = !narrower;
    if (narrower) this.element.dataset.zoom = `${Math.round(min!)}-${Math.round(max!)}`;
    else delete this.element.dataset.zoom;
  }

  #unzoom(): void {
    const xs = this.#plot.data[0];
    this.#zoom = null;
    if (xs.length > 0) this.#plot.setScale("x", { min: xs[0]!, max: xs[xs.length - 1]! });
    else this.#zoomed(this.#plot);
  }

  #data(): uPlot.AlignedData {
    const steps = [...new Set(this.#lines.flatMap((l) => [...l.values.keys()]))].sort(
      (a, b) => a - b,
    );
    // A log scale has no place for zero or below: such points are left out, not drawn at 0.
    const shown = (v: number | null) => (v === null || (this.#view.log && v <= 0) ? null : v);
    const columns: (number | null)[][] = [];
    for (const line of this.#lines) {
      const raw = steps.map((s) => shown(line.values.get(s) ?? null));
      if (this.#view.smoothing > 0 && !line.validation)
        columns.push(ema(raw, this.#view.smoothing), raw);
      else columns.push(raw);
    }
    const first = this.#lines[0]!;
    const firstShown = columns[0]!;
    return [
      steps,
      ...columns,
      steps.map((s, i) => (first.marks?.has(s) ? (firstShown[i] ?? null) : null)),
    ] as uPlot.AlignedData;
  }

  /** Smooths or rescales: the plot is built again with the new series and scale. */
  view(view: ChartView): void {
    if (view.smoothing === this.#view.smoothing && view.log === this.#view.log) return;
    this.#view = { ...view };
    const zoom = this.#zoom;
    this.#plot.destroy();
    this.#plot = this.#build();
    if (zoom) this.#plot.setScale("x", zoom);
    this.element.dataset.smoothing = String(view.smoothing);
    this.element.dataset.scale = view.log ? "log" : "linear";
  }

  update(): void {
    // While zoomed, new points do not pull the view back out to every step.
    const zoom = this.#zoom;
    this.#plot.setData(this.#data(), zoom === null);
    if (zoom) this.#plot.setScale("x", zoom);
    const points = this.#lines.reduce((n, l) => n + l.values.size, 0);
    this.#count.dataset.points = String(points);
    this.#count.textContent = points === 1 ? "1 point" : `${points} points`;
  }

  destroy(): void {
    this.#plot.destroy();
  }
}

/** The controls over a page's charts: smoothing (EMA weight, as W&B's slider) and log scale. */
export function chartControls(charts: readonly MetricChart[]): HTMLElement {
  const view: ChartView = { smoothing: 0, log: false };
  const weight = h("input", {
    type: "range",
    name: "smoothing",
    min: 0,
    max: 0.99,
    step: 0.01,
    value: 0,
    "aria-label": "Smoothing",
  });
  const shown = h("output", { class: "subtle" }, "0");
  const log = h("input", { type: "checkbox", name: "log_scale" });
  const apply = () => {
    view.smoothing = Number(weight.value);
    view.log = log.checked;
    shown.textContent = view.smoothing.toFixed(2);
    for (const c of charts) c.view(view);
  };
  weight.addEventListener("input", apply);
  log.addEventListener("change", apply);
  return h(
    "div",
    { class: "row wrap chart-controls" },
    h("label", { class: "check" }, "Smoothing ", weight, " ", shown),
    h("label", { class: "check" }, log, " Log scale"),
    h(
      "small",
      { class: "subtle" },
      "Drag across a chart to zoom; double-click it (or Reset zoom) to zoom out.",
    ),
  );
}
