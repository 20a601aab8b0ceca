import { describe, expect, it } from "vitest";
import { KERNEL_NAMES, named, paramsOf, positional } from "./table.ts";
import { MAX_ARGS } from "./wasm/jobs.ts";

describe("the kernel table", () => {
  it("when a kernel's arguments are given by name, then they are laid out in the table's order and read back by name", () => {
    const args = {
      out: 1,
      q: 2,
      k: 3,
      v: 4,
      n: 5,
      start: 6,
      H: 7,
      KV: 8,
      hd: 9,
      scale: 0.5,
      scores: 11,
    };
    expect(positional("attention", args)).toEqual([1, 2, 3, 4, 5, 6, 7, 8, 9, 0.5, 11]);
    expect(named("attention", positional("attention", args))).toEqual(args);
  });

  it("when a job calls any kernel, or runs one with a number of its own, then its arguments fit a task slot", () => {
    for (const name of KERNEL_NAMES)
      expect(paramsOf(name).length + 1).toBeLessThanOrEqual(MAX_ARGS);
  });
});
