import { readdirSync, readFileSync } from "node:fs";
import { loadSpec, specOperations } from "@arbor/server";
import { describe, expect, it } from "vitest";
import { pendingOperations } from "./pending.ts";

/** Every operationId of the spec has a `describe('<operationId>')` in a contract test, or is
 * listed as pending (answering 501, proven by pending.test.ts). */
describe("contract coverage", () => {
  const dir = new URL(".", import.meta.url);
  const described = new Set<string>();
  for (const file of readdirSync(dir).filter((f) => f.endsWith(".test.ts"))) {
    const text = readFileSync(new URL(file, dir), "utf8");
    for (const match of text.matchAll(/describe\(\s*["'`](\w+)/g)) described.add(match[1]!);
  }
  const operations = specOperations(loadSpec()).map((op) => op.operationId);

  it.each(operations)(
    "when %s is in the spec, then a contract test describes it or it is pending",
    (id) => {
      const isPending = pendingOperations.includes(id);
      expect(
        described.has(id) || isPending,
        `${id} has no describe("${id}") and is not pending`,
      ).toBe(true);
    },
  );
});
