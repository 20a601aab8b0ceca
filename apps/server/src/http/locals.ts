import type { Principal, ProjectRef } from "../modules/access.ts";
import type { UploadBudget, UploadReservation } from "./uploads.ts";

/** What the middlewares leave on `res.locals`, typed once for every reader. */
declare global {
  namespace Express {
    interface Locals {
      /** Set by `requestId` on every request. */
      requestId: string;
      /** Set when a spec operation matched. */
      operationId?: string;
      /** Set by `authentication` on every operation the spec does not mark public. */
      principal?: Principal;
      project?: ProjectRef;
      /** Set by `uploadAdmission` on an adapter upload: its share of the upload budget. */
      upload?: { reservation: UploadReservation; budget: UploadBudget };
    }
  }
}
