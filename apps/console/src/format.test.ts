import { describe, expect, it } from "vitest";
import {
  bucketFor,
  bucketStart,
  ema,
  eta,
  groupedModels,
  naturalCompare,
  tickLabels,
} from "./format.ts";

describe("tickLabels", () => {
  it("when learning rates a half-thousandth apart are labelled, then each label differs", () => {
    expect(tickLabels([0.003, 0.0025, 0.002, 0.0015])).toEqual([
      "3.0e-3",
      "2.5e-3",
      "2.0e-3",
      "1.5e-3",
    ]);
  });
  it("when tokens per second reach tens of thousands, then they read in thousands", () => {
    expect(tickLabels([10_000, 12_500, 15_000])).toEqual(["10.0k", "12.5k", "15.0k"]);
    expect(tickLabels([20_000, 40_000])).toEqual(["20k", "40k"]);
  });
  it("when losses are labelled, then as few digits as tell them apart", () => {
    expect(tickLabels([0.5, 1, 1.5, 2])).toEqual(["0.5", "1.0", "1.5", "2.0"]);
    expect(tickLabels([0, 2, 4])).toEqual(["0", "2", "4"]);
  });
  it("when a log scale's ticks span decades, then each reads as a power of ten", () => {
    expect(tickLabels([1e-8, 1e-6, 1e-4, 1e-2])).toEqual(["1e-8", "1e-6", "1e-4", "1e-2"]);
    expect(tickLabels([0.001, 0.1, 10])).toEqual(["1e-3", "1e-1", "1e1"]);
    expect(tickLabels([0.1, 1, 10, 100])).toEqual(["0.1", "1.0", "10.0", "100.0"]);
  });
  it("when uPlot leaves a tick out (null), then its label is empty", () => {
    expect(tickLabels([null, 0.1, null, 1])).toEqual(["", "0.1", "", "1.0"]);
  });
});

describe("ema", () => {
  it("when the weight is 0, then the values are unchanged", () => {
    expect(ema([1, 2, null, 3], 0)).toEqual([1, 2, null, 3]);
  });
  it("when smoothing, then the first point is itself (debiased) and later ones lag behind", () => {
    const s = ema([1, 3, 3], 0.5);
    expect(s[0]).toBeCloseTo(1);
    // (0.5·0.5 + 0.5·3) / (1 − 0.25) = 1.75 / 0.75
    expect(s[1]).toBeCloseTo(1.75 / 0.75);
    expect(s[2]!).toBeLessThan(3);
  });
});

describe("legend order", () => {
  it("when checkpoints are named by step, then step2 comes before step10, under their model", () => {
    expect(["a:step10", "a:step2", "a:step1"].sort(naturalCompare)).toEqual([
      "a:step1",
      "a:step2",
      "a:step10",
    ]);
    expect(groupedModels(["d/p/m:step10", "base-x", "d/p/m", "d/p/m:step2"])).toEqual([
      { model: "base-x", ids: ["base-x"] },
      { model: "d/p/m", ids: ["d/p/m", "d/p/m:step2", "d/p/m:step10"] },
    ]);
  });
});

describe("buckets", () => {
  it("when the range is a week, a month or a year, then days, weeks or months", () => {
    expect(bucketFor(7).name).toBe("day");
    expect(bucketFor(30).name).toBe("week");
    expect(bucketFor(365).name).toBe("month");
  });
  it("when a day is bucketed, then weeks start on Monday and months on the first", () => {
    // 2026-11-27 is a Friday.
    expect(bucketStart("2026-11-27", bucketFor(30))).toBe("2026-11-23");
    expect(bucketStart("2026-11-23", bucketFor(30))).toBe("2026-11-23");
    expect(bucketStart("2026-11-27", bucketFor(365))).toBe("2026-11-01");
  });
});

describe("eta", () => {
  it("when 171 of 600 steps took 171 s, then about 7 min are left", () => {
    expect(eta(171, 171, 429)).toBe("about 7 min left");
  });
  it("when nothing is done yet, then no guess", () => {
    expect(eta(0, 10, 600)).toBeNull();
  });
});
