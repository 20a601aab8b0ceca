/**
 * Sums the vitest JSON reports (`test-results.json`) of every workspace package that has a test
 * script, and prints one line for the whole run: `N passed, N failed[, N skipped]`. A package
 * whose report is missing (its run crashed before reporting) counts as a failure, by name, so a
 * run that executed no test never looks green.
 */
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";

interface Report {
  testResults: {
    assertionResults: { status: string; ancestorTitles: string[]; title: string }[];
  }[];
  numPassedTests: number;
  numFailedTests: number;
  numPendingTests: number;
  numTodoTests: number;
  numFailedTestSuites: number;
  numTotalTests: number;
}

const root = join(import.meta.dirname, "..");
const groups = ["packages", "apps", "tests"];
let passed = 0;
let failed = 0;
let skipped = 0;
const rows: string[] = [];
for (const group of groups) {
  for (const name of readdirSync(join(root, group)).sort()) {
    const dir = join(root, group, name);
    const manifest = join(dir, "package.json");
    if (!existsSync(manifest)) continue;
    const pkg = JSON.parse(readFileSync(manifest, "utf8")) as {
      name: string;
      scripts?: Record<string, string>;
    };
    if (!pkg.scripts?.test) continue;
    const file = join(dir, "test-results.json");
    if (!existsSync(file)) {
      failed += 1;
      rows.push(`${pkg.name}: no test report (the test run did not finish)`);
      continue;
    }
    const r = JSON.parse(readFileSync(file, "utf8")) as Report;
    // A test file that fails to load has no tests but is a failed suite: count it.
    const brokenFiles = r.numFailedTests === 0 ? r.numFailedTestSuites : 0;
    passed += r.numPassedTests;
    failed += r.numFailedTests + brokenFiles;
    skipped += r.numPendingTests + r.numTodoTests;
    rows.push(
      `${pkg.name}: ${r.numPassedTests} passed, ${r.numFailedTests + brokenFiles} failed, ${r.numPendingTests + r.numTodoTests} skipped`,
    );
    // Which suites were skipped (a Postgres half without PostgreSQL, say), so quiet logs hide none.
    const skippedSuites = new Map<string, number>();
    for (const file of r.testResults) {
      for (const test of file.assertionResults) {
        if (test.status !== "pending" && test.status !== "skipped" && test.status !== "todo")
          continue;
        const suite = test.ancestorTitles[0] ?? test.title;
        skippedSuites.set(suite, (skippedSuites.get(suite) ?? 0) + 1);
      }
    }
    for (const [suite, count] of skippedSuites) rows.push(`  skipped: ${suite} (${count})`);
  }
}
for (const row of rows) console.log(`  ${row}`);
console.log(`${passed} passed, ${failed} failed${skipped > 0 ? `, ${skipped} skipped` : ""}`);
process.exitCode = failed > 0 || passed === 0 ? 1 : 0;
