import { DATASET_MAX_BYTES } from "@arbor/training";
import express from "express";
import type { ServerModule } from "../module.ts";
import { datasetsHandlers } from "./routes.ts";
import { DATASET_MEDIA_TYPES } from "./service.ts";

/** Datasets, uploaded as their JSONL text. */
export const datasetsModule: ServerModule = {
  name: "datasets",
  beforeValidation(app) {
    app.use(
      "/v1/preview/datasets",
      express.text({ type: DATASET_MEDIA_TYPES, limit: DATASET_MAX_BYTES }),
    );
  },
  handlers: ({ store }) => datasetsHandlers(store),
};
