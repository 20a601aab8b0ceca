import type { Store } from "@arbor/store";
import type { Request } from "express";
import type { ProjectRef } from "../../http/auth.ts";
import { ApiError } from "../../http/errors.ts";
import type { Handlers } from "../../http/operations.ts";
import { createDataset } from "./service.ts";

/** Datasets (CONTRACT §5, spec/ADR.md entry 15): raw JSONL uploads for SFT. */
export function datasetsHandlers(store: Store): Handlers {
  return {
    createDataset: async ({ req, res, query }) => {
      // The text parser mounted for this path (app.ts) leaves the body as a string.
      if (typeof req.body !== "string" && hasBody(req)) {
        throw new Error("createDataset: no text parser is mounted for /v1/preview/datasets.");
      }
      const text = typeof req.body === "string" ? req.body : "";
      if (!/\S/.test(text)) {
        throw ApiError.badRequest(
          "The request body is empty: send the JSONL itself, one {messages, tools?} object per line.",
          null,
          "invalid_dataset",
        );
      }
      // Datasets belong to the project header's entity (the key's default entity when the
      // header is absent), so a member of several entities can upload for any of them.
      const { entity } = res.locals.project as ProjectRef;
      const name = typeof query.name === "string" && query.name !== "" ? query.name : null;
      return createDataset(store, { entity, name, text });
    },
  };
}

function hasBody(req: Request): boolean {
  const length = req.headers["content-length"];
  return req.headers["transfer-encoding"] !== undefined || (length !== undefined && length !== "0");
}
