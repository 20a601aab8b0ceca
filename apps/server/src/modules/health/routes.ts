import { type Handlers, RESPONDED } from "../../http/operations.ts";
import { type Probes, systemCheck } from "./service.ts";

export function healthHandlers(probes: Probes): Handlers {
  return {
    getHealth: () => ({ status: "ok" }),
    getSystemCheck: async ({ res }) => {
      const { healthy, report } = await systemCheck(probes);
      if (healthy) return report;
      res.setHeader("Retry-After", "5");
      res.status(503).json(report);
      return RESPONDED;
    },
  };
}
