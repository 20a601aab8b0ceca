/**
 * Time limits shared by every package's tests. A test here never fails because the machine is
 * slow: CI shares two cores with other work, and a load average of 17 has been seen. So no test
 * sets a time limit of its own unless time is the behaviour under test, and the limits below only
 * end a run that has hung.
 */
import { defineConfig } from "vitest/config";

/** How long one test, hook or teardown may take before it is taken to have hung. */
export const HUNG_MS = 900_000;

/** For `vi.waitFor`, whose own default gives up after 1 s: poll often, give up only on a hang. */
export const PATIENT = { timeout: 300_000, interval: 50 } as const;

export default defineConfig({
  test: {
    testTimeout: HUNG_MS,
    hookTimeout: HUNG_MS,
    teardownTimeout: HUNG_MS,
  },
});
