import { fileURLToPath } from "node:url";

/** The built console (`pnpm --filter @arbor/console build`), served at `/console`. */
export const consoleDir = fileURLToPath(new URL("./dist/", import.meta.url));
