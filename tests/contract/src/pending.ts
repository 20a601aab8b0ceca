import type { operations } from "@arbor/client";

/**
 * The one place that lists the operations still answering 501 (not implemented yet).
 * `pending.test.ts` proves each answers 501 in its surface's envelope, and that this list is
 * exactly the server's set of operations without a handler: implementing one fails the test
 * until it is removed here and given its own contract tests.
 */
export const pendingOperations: (keyof operations)[] = [];
