import { StringDecoder } from "node:string_decoder";
import type { DpoPair, SftExample as EngineSftExample } from "@arbor/engine/train";
import type { components } from "@arbor/spec/schema";
import { type Dataset, NotFoundError, quote, type Store } from "@arbor/store";
import {
  type DatasetKind,
  dpoPairsFromLines,
  kindOf,
  parseDatasetLine,
  sftExamplesFromLines,
  validateSftJsonlAsync,
} from "./jsonl.ts";

type DatasetLine = components["schemas"]["DatasetLine"];

/** The cap on an upload (the server's body parser for the upload path enforces it: 413). */
export const DATASET_MAX_BYTES = 64 * 1024 * 1024;

/** `dataset://<id>`: what `createSftTrainingJob` takes as `training_data_url`. */
export function datasetUrl(id: string): string {
  return `dataset://${id}`;
}

/** `dataset://<id>` → `<id>`; anything else → undefined. */
export function datasetIdOf(url: string): string | undefined {
  const match = /^dataset:\/\/([0-9a-fA-F-]{36})\/?$/.exec(url.trim());
  return match?.[1]?.toLowerCase();
}

/** Datasets' JSONL files live under this prefix. */
export const DATASETS_PREFIX = "datasets/";

/** Where a dataset's JSONL lives. */
export function datasetBlobKey(id: string): string {
  return `${DATASETS_PREFIX}${id}.jsonl`;
}

/** Checks every line, then stores the blob (atomically) and only then the row, so a rejected or
 * failed upload leaves no row behind. */
export async function createDataset(
  store: Store,
  input: { entity: string; name: string | null; filename?: string | null; text: string },
): Promise<Dataset> {
  const { lines } = await validateSftJsonlAsync(input.text);
  const blobs = store.blobs;
  const id = store.datasets.newId();
  const blob_key = datasetBlobKey(id);
  const { bytes } = await blobs.put(blob_key, input.text);
  try {
    return await store.datasets.create({
      id,
      entity: input.entity,
      name: input.name,
      filename: input.filename ?? null,
      blob_key,
      bytes,
      lines,
    });
  } catch (err) {
    await blobs.delete(blob_key).catch(() => {});
    throw err;
  }
}

/** One of `entity`'s datasets; another entity's reads as missing. */
export async function findDataset(store: Store, entity: string, id: string): Promise<Dataset> {
  const dataset = await store.datasets.get(entity, id);
  if (!dataset) {
    throw new NotFoundError(`Dataset ${quote(id)} not found.`, { code: "dataset_not_found" });
  }
  return dataset;
}

/** A dataset's examples as the engine trains on them, read from the blob store as a stream, a
 * line at a time: the file is never held whole (not as bytes, nor as text). */
export async function datasetExamples(store: Store, dataset: Dataset): Promise<EngineSftExample[]> {
  const stream = await store.blobs.stream(dataset.blob_key);
  if (!stream) throw missingBlob(dataset);
  try {
    return await sftExamplesFromLines(lines(stream));
  } finally {
    stream.destroy();
  }
}

/** A dataset's preference pairs as the engine trains on them (a DPO job's), read as a stream. */
export async function datasetPairs(store: Store, dataset: Dataset): Promise<DpoPair[]> {
  const stream = await store.blobs.stream(dataset.blob_key);
  if (!stream) throw missingBlob(dataset);
  try {
    return await dpoPairsFromLines(lines(stream));
  } finally {
    stream.destroy();
  }
}

/** What a dataset holds, SFT examples or DPO pairs: its first line's kind (the upload checked
 * that every line is of it). Reads the blob only to the end of that line. */
export async function datasetKind(store: Store, dataset: Dataset): Promise<DatasetKind> {
  const stream = await store.blobs.stream(dataset.blob_key);
  if (!stream) throw missingBlob(dataset);
  try {
    for await (const raw of lines(stream)) {
      if (raw.trim() === "") continue;
      try {
        return kindOf(JSON.parse(raw.replace(/^\ufeff/, "")));
      } catch (err) {
        throw new Error(`Dataset ${dataset.id}: its first line is not JSON`, { cause: err });
      }
    }
  } finally {
    stream.destroy();
  }
  throw new Error(`Dataset ${dataset.id} has no lines`);
}

/** The stored JSONL of a dataset. */
export async function datasetText(store: Store, dataset: Dataset): Promise<string> {
  const blob = await store.blobs.get(dataset.blob_key);
  if (!blob) throw missingBlob(dataset);
  return blob.toString("utf8");
}

/** A page of a dataset's examples after line `after` (0: from the start). The file is read as a
 * stream, line by line (split at `\n` only, as uploads are), and lines before the page are not
 * parsed: a page of a 64 MB dataset holds neither the file in memory nor the event loop for long.
 * A stored line that no longer validates is the store's fault, not the caller's: a plain error. */
export async function datasetLines(
  store: Store,
  dataset: Dataset,
  page: { after: number; limit: number },
): Promise<{ data: DatasetLine[]; has_more: boolean }> {
  const stream = await store.blobs.stream(dataset.blob_key);
  if (!stream) throw missingBlob(dataset);
  const data: DatasetLine[] = [];
  try {
    let line = 0;
    for await (const raw of lines(stream)) {
      line++;
      if (line <= page.after || raw.trim() === "") continue;
      if (data.length === page.limit) return { data, has_more: true };
      let example: DatasetLine["example"];
      try {
        // Each line as its own kind: the upload checked that they are all of one.
        example = parseDatasetLine(line === 1 ? raw.replace(/^\ufeff/, "") : raw, line, {
          by: "dataset",
        }).example;
      } catch (err) {
        throw new Error(`Dataset ${dataset.id}: stored line ${line} does not validate`, {
          cause: err,
        });
      }
      data.push({ id: String(line), object: "dataset.line", line, example });
    }
  } finally {
    stream.destroy();
  }
  return { data, has_more: false };
}

/** The `\n`-separated lines of a UTF-8 stream, decoded across chunk boundaries. */
async function* lines(stream: AsyncIterable<Buffer>): AsyncGenerator<string> {
  const decoder = new StringDecoder("utf8");
  let pending = "";
  for await (const chunk of stream) {
    pending += decoder.write(chunk);
    let start = 0;
    for (let end = pending.indexOf("\n"); end >= 0; end = pending.indexOf("\n", start)) {
      yield pending.slice(start, end);
      start = end + 1;
    }
    pending = pending.slice(start);
  }
  yield pending + decoder.end();
}

function missingBlob(dataset: Dataset): Error {
  return new Error(`Dataset ${dataset.id} has a row but no blob at ${dataset.blob_key}.`);
}
