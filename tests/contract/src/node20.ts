import { execFileSync } from "node:child_process";

/** The machine's own Node (20 here), beside the project's Node 24 that runs the tests. */
export const NODE_20 = process.env.ARBOR_NODE_20 ?? "/usr/bin/node";

/**
 * Whether this machine has a Node 20 to run packed packages under. CI machines do: there its
 * absence is an error, not a skip.
 */
export const node20 = (() => {
  try {
    return execFileSync(NODE_20, ["--version"], { encoding: "utf8" }).startsWith("v20.");
  } catch {
    return false;
  }
})();
if (!node20 && process.env.CI === "true")
  throw new Error(`${NODE_20} is not Node 20: set ARBOR_NODE_20 to one for the package tests.`);
