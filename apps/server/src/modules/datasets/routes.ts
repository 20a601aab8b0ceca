import { InvalidInputError, NotFoundError, quote, type Store } from "@arbor/store";
import { createDataset, datasetLines } from "@arbor/training";
import type { Request } from "express";
import type { Handlers } from "../../http/operations.ts";
import { findOwned } from "../access.ts";
import { datasetToWire } from "./service.ts";

/** Datasets (ADR 15): raw JSONL uploads for SFT. */
export function datasetsHandlers(store: Store): Handlers {
  return {
    createDataset: async ({ req, query, project }) => {
      // The text parser mounted for this path (app.ts) leaves the body as a string.
      if (typeof req.body !== "string" && hasBody(req)) {
        throw new Error("createDataset: no text parser is mounted for /v1/preview/datasets.");
      }
      const text = typeof req.body === "string" ? req.body : "";
      if (!/\S/.test(text)) {
        throw new InvalidInputError(
          "The request body is empty: send the JSONL itself, one {messages, tools?} object per line.",
          { code: "invalid_dataset" },
        );
      }
      // Datasets belong to the project header's entity (the key's default entity when the
      // header is absent), so a member of several entities can upload for any of them.
      const name = typeof query.name === "string" && query.name !== "" ? query.name : null;
      return datasetToWire(await createDataset(store, { entity: project.entity, name, text }));
    },

    listDatasets: async ({ query, principal }) => {
      const page = await store.datasets.list(principal.entities, {
        after: query.after,
        limit: query.limit ?? 20,
        name: query.name,
        order: "desc",
      });
      return { object: "list", ...page, data: page.data.map(datasetToWire) };
    },

    listDatasetLines: async ({ params, query, principal }) => {
      const id = params.dataset_id;
      const dataset = await findOwned(principal, (entity) => store.datasets.get(entity, id));
      if (!dataset) {
        throw new NotFoundError(`Dataset ${quote(id)} not found.`, { code: "dataset_not_found" });
      }
      const after = query.after === undefined ? 0 : Number(query.after);
      if (!Number.isSafeInteger(after) || after < 0) {
        throw new InvalidInputError("after must be a line number (the last_id of a page).", {
          param: "after",
          code: "invalid_cursor",
        });
      }
      const page = await datasetLines(store, dataset, { after, limit: query.limit ?? 20 });
      return {
        object: "list",
        data: page.data,
        first_id: page.data[0]?.id ?? null,
        last_id: page.data.at(-1)?.id ?? null,
        has_more: page.has_more,
      };
    },
  };
}

function hasBody(req: Request): boolean {
  const length = req.headers["content-length"];
  return req.headers["transfer-encoding"] !== undefined || (length !== undefined && length !== "0");
}
