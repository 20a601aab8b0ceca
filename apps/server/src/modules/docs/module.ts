import type { ServerModule } from "../module.ts";
import { publicDocuments } from "./routes.ts";

/** `/docs` and the spec itself, public. */
export const docsModule: ServerModule = {
  name: "docs",
  beforeAuthentication(app, { spec }) {
    app.use(publicDocuments(spec));
  },
};
