/** Pure helpers for the console's charts and tables: no DOM here, so they are unit-tested. */

/**
 * Labels for axis ticks that tell neighbours apart: the fewest digits with which every label
 * differs and reads back within a hundredth of the step between ticks. Small and large values
 * read in exponent form (`3.0e-3`, `2.5e-3`), thousands with a `k` (`12.5k`).
 */
export function tickLabels(ticks: readonly (number | null)[]): string[] {
  // uPlot leaves out ticks it will not draw (null), on a log scale say.
  const values = ticks.filter((v): v is number => v !== null && Number.isFinite(v));
  if (values.length === 0) return ticks.map(() => "");
  const labels = labelsOf(values);
  let i = 0;
  return ticks.map((v) => (v !== null && Number.isFinite(v) ? labels[i++]! : ""));
}

function labelsOf(values: readonly number[]): string[] {
  // Each label reads back within a hundredth of the gap to its nearest neighbour: linear ticks
  // have one gap, a log scale's grow tenfold from tick to tick.
  const gap = (i: number): number => {
    const gaps = [values[i - 1], values[i + 1]]
      .filter((n): n is number => n !== undefined)
      .map((n) => Math.abs(n - values[i]!));
    return gaps.length > 0 ? Math.min(...gaps) : Math.abs(values[i]!) || 1;
  };
  const magnitudes = values.map(Math.abs).filter((v) => v > 0);
  const biggest = Math.max(0, ...magnitudes);
  const smallest = Math.min(...magnitudes);
  // Exponent form for the very small and the very large, and for ticks over several decades.
  const exponent =
    biggest > 0 &&
    (biggest < 1e-2 || biggest >= 1e6 || (biggest / smallest >= 1e3 && smallest < 1e-2));
  const thousands = !exponent && biggest >= 1e4;
  const format = (v: number, digits: number): string => {
    if (v === 0) return "0";
    if (exponent) return v.toExponential(digits).replace("e+", "e");
    if (thousands) return `${(v / 1000).toFixed(digits)}k`;
    return v.toFixed(digits);
  };
  const readBack = (label: string): number =>
    label.endsWith("k") ? Number(label.slice(0, -1)) * 1000 : Number(label);
  for (let digits = 0; digits <= 8; digits++) {
    const labels = values.map((v) => format(v, digits));
    const distinct = new Set(labels).size === labels.length;
    const close = values.every((v, i) => Math.abs(readBack(labels[i]!) - v) <= gap(i) / 100);
    if (distinct && close) return labels;
  }
  return values.map((v) => String(v));
}

/**
 * Exponential moving average as W&B draws it: `s = w·s + (1 − w)·v`, divided by `1 − w^n`
 * so that the first points are not pulled towards zero. Gaps (null) are carried over.
 */
export function ema(values: readonly (number | null)[], weight: number): (number | null)[] {
  if (weight <= 0) return [...values];
  let last = 0;
  let n = 0;
  return values.map((v) => {
    if (v === null || !Number.isFinite(v)) return null;
    last = last * weight + (1 - weight) * v;
    n++;
    return last / (1 - weight ** n);
  });
}

/** `step2` before `step10`: text compared with its numbers as numbers. */
export const naturalCompare = new Intl.Collator("en", { numeric: true }).compare;

/** A checkpoint's model: `entity/project/name:step12` → `entity/project/name`. */
export function modelOf(id: string): string {
  const colon = id.lastIndexOf(":");
  return colon > 0 && /^step\d+$/.test(id.slice(colon + 1)) ? id.slice(0, colon) : id;
}

/**
 * Model ids sorted for a legend: each model, then its checkpoints by step; a checkpoint whose
 * model itself has no usage still sits with its siblings.
 */
export function groupedModels(ids: Iterable<string>): { model: string; ids: string[] }[] {
  const groups = new Map<string, string[]>();
  for (const id of ids) {
    const model = modelOf(id);
    groups.set(model, [...(groups.get(model) ?? []), id]);
  }
  return [...groups]
    .sort(([a], [b]) => naturalCompare(a, b))
    .map(([model, members]) => ({
      model,
      ids: members.sort((a, b) => (a === model ? -1 : b === model ? 1 : naturalCompare(a, b))),
    }));
}

export interface Bucket {
  /** What a bucket is called in the chart's title. */
  name: "day" | "week" | "month";
  /** Days in a bucket (a month counts as 30 for the choice; its buckets are calendar months). */
  days: number;
}

/** Days for up to two weeks, weeks up to about four months, months beyond: a chart of a range
 * has between a handful and a few dozen bars. */
export function bucketFor(days: number): Bucket {
  if (days <= 14) return { name: "day", days: 1 };
  if (days <= 120) return { name: "week", days: 7 };
  return { name: "month", days: 30 };
}

/** The first day (`YYYY-MM-DD`) of the bucket a day falls in: weeks start on Monday. */
export function bucketStart(day: string, bucket: Bucket): string {
  if (bucket.name === "day") return day;
  if (bucket.name === "month") return `${day.slice(0, 7)}-01`;
  const t = Date.parse(`${day}T00:00:00Z`);
  const weekday = (new Date(t).getUTCDay() + 6) % 7;
  return new Date(t - weekday * 86_400_000).toISOString().slice(0, 10);
}

/** `about 3 min left` from progress so far: steps done in the time they took. */
export function eta(stepsDone: number, seconds: number, stepsLeft: number): string | null {
  if (stepsDone <= 0 || seconds <= 0 || stepsLeft < 0) return null;
  const left = (stepsLeft * seconds) / stepsDone;
  if (left < 60) return `about ${Math.max(1, Math.round(left))} s left`;
  if (left < 3600) return `about ${Math.round(left / 60)} min left`;
  return `about ${(left / 3600).toFixed(1)} h left`;
}
