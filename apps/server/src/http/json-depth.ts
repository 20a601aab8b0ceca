/** The deepest nesting a JSON request body may have (documented in the spec's description). */
export const MAX_JSON_DEPTH = 128;

/**
 * Whether a parsed JSON value nests arrays and objects deeper than `max`, walked without
 * recursion: the walk visits nodes, not bytes, so a body that is one long string costs nothing.
 * Recursive code later on (validation, hashing, storing) then never meets a depth that could
 * overflow its stack.
 */
export function nestsDeeperThan(value: unknown, max: number): boolean {
  const stack: [unknown, number][] = [[value, 1]];
  while (stack.length > 0) {
    const [node, depth] = stack.pop()!;
    if (typeof node !== "object" || node === null) continue;
    if (depth > max) return true;
    const children = Array.isArray(node) ? node : Object.values(node);
    for (const child of children) {
      if (typeof child === "object" && child !== null) stack.push([child, depth + 1]);
    }
  }
  return false;
}
