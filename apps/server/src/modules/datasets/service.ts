import type { components } from "@arbor/spec/schema";
import type { Dataset } from "@arbor/store";
import { datasetUrl } from "@arbor/training";

/** The media types `createDataset` takes (ADR 15). */
export const DATASET_MEDIA_TYPES = ["application/jsonl", "application/x-ndjson", "text/plain"];

export function datasetToWire(dataset: Dataset): components["schemas"]["Dataset"] {
  return {
    id: dataset.id,
    object: "dataset",
    url: datasetUrl(dataset.id),
    name: dataset.name,
    bytes: dataset.bytes,
    lines: dataset.lines,
    created_at: dataset.created_at,
  };
}
