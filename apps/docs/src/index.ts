import { fileURLToPath } from "node:url";

/** The built reference page; `pnpm --filter @arbor/docs build` writes it. */
export const docsHtmlPath = fileURLToPath(new URL("../dist/index.html", import.meta.url));
