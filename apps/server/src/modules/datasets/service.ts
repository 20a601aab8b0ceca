import type { components } from "@arbor/spec/schema";
import type { Dataset, Store } from "@arbor/store";
import { InvalidDatasetError, validateSftJsonl } from "@arbor/training";
import { ApiError } from "../../http/errors.ts";

/** The cap on an upload; the text parser mounted for this path enforces it (413). */
export const DATASET_MAX_BYTES = 64 * 1024 * 1024;

/** The media types `createDataset` takes (spec/ADR.md entry 15). */
export const DATASET_MEDIA_TYPES = ["application/jsonl", "application/x-ndjson", "text/plain"];

export function datasetUrl(id: string): string {
  return `dataset://${id}`;
}

export function blobKeyOf(id: string): string {
  return `datasets/${id}.jsonl`;
}

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

/** Checks every line, then stores the blob (atomically) and only then the row, so a rejected
 * or failed upload leaves no row behind. */
export async function createDataset(
  store: Store,
  input: { entity: string; name: string | null; text: string },
): Promise<components["schemas"]["Dataset"]> {
  let lines: number;
  try {
    ({ lines } = validateSftJsonl(input.text));
  } catch (err) {
    if (err instanceof InvalidDatasetError) {
      throw ApiError.badRequest(err.message, null, "invalid_dataset");
    }
    throw err;
  }
  const blobs = store.blobs;
  if (!blobs) throw new Error("The store has no blob directory; datasets need one.");
  const id = store.datasets.newId();
  const blob_key = blobKeyOf(id);
  const { bytes } = await blobs.put(blob_key, input.text);
  try {
    const dataset = await store.datasets.create({
      id,
      entity: input.entity,
      name: input.name,
      blob_key,
      bytes,
      lines,
    });
    return datasetToWire(dataset);
  } catch (err) {
    await blobs.delete(blob_key).catch(() => {});
    throw err;
  }
}
