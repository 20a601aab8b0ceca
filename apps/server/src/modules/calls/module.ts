import type { ServerModule } from "../module.ts";
import { callsHandlers } from "./routes.ts";

/** Calls and their traces. */
export const callsModule: ServerModule = {
  name: "calls",
  handlers: ({ store }) => callsHandlers(store),
};
