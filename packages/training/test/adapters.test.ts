import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Readable } from "node:stream";
import { gzipSync } from "node:zlib";
import {
  adapterToFiles,
  catalogModelDir,
  createLoraAdapter,
  type Model as EngineModel,
  loadModel,
} from "@arbor/engine/model";
import { DomainError, InvalidInputError, type Model, openStore, type Store } from "@arbor/store";
import tar from "tar-stream";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  ADAPTER_MAX_BYTES,
  checkpointAdapterTar,
  importAdapter,
  readAdapterTar,
  reprDigest,
} from "../src/adapters.ts";
import { entryHeader, gzipBomb } from "./tar-fixtures.ts";

/** Adapters in and out without HTTP: tars read and written, and what an import checks. */
let dataDir: string;
let store: Store;
let model: Model;
let base: EngineModel;
beforeAll(async () => {
  dataDir = mkdtempSync(join(tmpdir(), "arbor-adapters-"));
  store = await openStore({ dataDir });
  await store.entities.ensure("e");
  ({ model } = await store.models.create({
    entity: "e",
    project: "p",
    name: "m",
    base_model: "arbor/tiny-chat",
    initialCheckpoint: { step: 0, blob_key: null },
  }));
  base = await loadModel(catalogModelDir("arbor/tiny-chat"));
});
afterAll(async () => {
  await store.close();
  rmSync(dataDir, { recursive: true, force: true });
});

async function tarOf(entries: { name: string; body: Uint8Array | string }[]): Promise<Buffer> {
  const pack = tar.pack();
  for (const { name, body } of entries) pack.entry({ name }, Buffer.from(body));
  pack.finalize();
  const chunks: Buffer[] = [];
  for await (const chunk of pack) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks);
}

const adapterFiles = (rank = 2) =>
  adapterToFiles(createLoraAdapter(base, { rank, alpha: 4, baseModel: "arbor/tiny-chat" }, 1));

const entries = (files: Record<string, Uint8Array>, folder = "") =>
  Object.entries(files).map(([name, body]) => ({ name: `${folder}${name}`, body }));

async function bad(body: Uint8Array): Promise<InvalidInputError> {
  const err = await readAdapterTar(body).then(
    () => undefined,
    (e: unknown) => e,
  );
  expect(err).toBeInstanceOf(InvalidInputError);
  return err as InvalidInputError;
}

describe("readAdapterTar", () => {
  it("when the files are at the top, in one folder, or gzipped, with a README beside, then both are read", async () => {
    const files = adapterFiles();
    for (const body of [
      await tarOf(entries(files)),
      await tarOf([{ name: "README.md", body: "# adapter" }, ...entries(files, "./my-adapter/")]),
      gzipSync(await tarOf(entries(files, "out/"))),
    ]) {
      const read = await readAdapterTar(body);
      expect(Object.keys(read).sort()).toEqual([
        "adapter_config.json",
        "adapter_model.safetensors",
      ]);
      expect(Buffer.from(read["adapter_model.safetensors"]!)).toEqual(
        Buffer.from(files["adapter_model.safetensors"]!),
      );
    }
  });

  it("when a tar climbs out of its folder, is cut off, is not a tar, or lacks a file, then it is refused naming why", async () => {
    const files = adapterFiles();
    const traversal = await tarOf([
      ...entries(files),
      { name: "../../etc/adapter_config.json", body: "{}" },
    ]);
    expect((await bad(traversal)).message).toMatch(/leaves the archive's folder/);
    const whole = await tarOf(entries(files));
    expect((await bad(whole.subarray(0, 1500))).message).toMatch(/not a complete tar/);
    expect((await bad(Buffer.from('{"not": "a tar"}'.repeat(40)))).message).toMatch(
      /not a complete tar/,
    );
    const half = await tarOf([
      { name: "adapter_config.json", body: files["adapter_config.json"]! },
    ]);
    expect(await bad(half)).toMatchObject({ param: "adapter_model.safetensors" });
    const twice = await tarOf([...entries(files), ...entries(files, "again/")]);
    expect((await bad(twice)).message).toMatch(/twice/);
    expect((await bad(new Uint8Array())).message).toMatch(/empty/);
  });
});

describe("readAdapterTar: bounded work", () => {
  it("when a gzipped tar unzips to 1 GiB (a bomb), then it is refused once the output passes the cap, without holding it", async () => {
    const bomb = gzipBomb(await entryHeader("README.md", 1024 * 1024 * 1024), 1024 * 1024 * 1024);
    expect(bomb.length).toBeLessThan(2 * 1024 * 1024);
    const err = await bad(bomb);
    expect(err.message).toBe(`The tar is over ${ADAPTER_MAX_BYTES} bytes unzipped.`);
    expect(err.code).toBe("invalid_adapter");
  });

  it("when an entry of the tar says it is larger than the cap, or the config larger than a config can be, then it is refused at its header", async () => {
    const huge = gzipBomb(await entryHeader("adapter_model.safetensors", 1 << 30), 1 << 30);
    expect(await bad(huge)).toMatchObject({
      param: "adapter_model.safetensors",
      message: `The tar's adapter_model.safetensors is 1073741824 bytes, over ${ADAPTER_MAX_BYTES}.`,
    });
    const config = await tarOf([{ name: "adapter_config.json", body: "{}".padEnd(2 << 20) }]);
    expect(await bad(config)).toMatchObject({ param: "adapter_config.json" });
  });

  it("when the body itself passes the cap as it streams in, then it is too large", async () => {
    const header = await entryHeader("README.md", ADAPTER_MAX_BYTES + (2 << 20));
    async function* body() {
      yield header;
      const chunk = new Uint8Array(1 << 20);
      for (let sent = 0; sent <= ADAPTER_MAX_BYTES; sent += chunk.length) yield chunk;
    }
    const err = await readAdapterTar(body()).then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(DomainError);
    expect(err).toMatchObject({ kind: "too_large", code: "request_too_large" });
  });

  it("when a gzip stream is corrupt, then it is refused as gzip", async () => {
    const zipped = gzipSync(await tarOf(entries(adapterFiles())));
    zipped.fill(0x55, 20, 60);
    expect((await bad(zipped)).message).toMatch(/^The body is not a valid gzip stream/);
  });
});

describe("importAdapter and checkpointAdapterTar", () => {
  it("when an adapter is imported, then it is the next step, and its tar streams out with the length and digest it states", async () => {
    const checkpoint = await importAdapter(store, {
      model,
      baseConfig: base.config,
      files: adapterFiles(),
    });
    expect(checkpoint.step).toBe(1);
    const out = await checkpointAdapterTar(store.blobs, checkpoint, "m-step1");
    const chunks: Buffer[] = [];
    for await (const chunk of out.open()) chunks.push(chunk as Buffer);
    const body = Buffer.concat(chunks);
    expect(body.length).toBe(out.bytes);
    expect(await reprDigest(out.open())).toBe(await reprDigest(Readable.from([body])));
    const back = await readAdapterTar(body);
    expect(JSON.parse(Buffer.from(back["adapter_config.json"]!).toString())).toMatchObject({
      peft_type: "LORA",
      r: 2,
      lora_alpha: 4,
      base_model_name_or_path: "arbor/tiny-chat",
    });
  });

  it("when an adapter does not fit the base, then nothing is stored and the error names the field or tensor", async () => {
    const before = await store.blobs.list("checkpoints/");
    const latest = (await store.models.get("e", model.id))!;
    const wrongBase = adapterToFiles(
      createLoraAdapter(base, { rank: 2, alpha: 4, baseModel: "Qwen/Qwen3-0.6B" }, 1),
    );
    const cases: [Record<string, Uint8Array>, string][] = [
      [wrongBase, "base_model_name_or_path"],
      [
        { ...adapterFiles(2), "adapter_config.json": adapterFiles(4)["adapter_config.json"]! },
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
      ],
    ];
    for (const [files, param] of cases) {
      const err = await importAdapter(store, {
        model: latest,
        baseConfig: base.config,
        files,
      }).then(
        () => undefined,
        (e: unknown) => e,
      );
      expect(err).toBeInstanceOf(InvalidInputError);
      expect(err).toMatchObject({ param, code: "invalid_adapter" });
    }
    expect(await store.blobs.list("checkpoints/")).toEqual(before);
    expect((await store.models.get("e", model.id))!.latest_step).toBe(latest.latest_step);
  });

  it("when the adapter's weights are not finite numbers, or absurdly large, then nothing is stored and the error names the tensor", async () => {
    const before = await store.blobs.list("checkpoints/");
    const latest = (await store.models.get("e", model.id))!;
    const name = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight";
    for (const value of [Number.NaN, Number.POSITIVE_INFINITY, 1e30]) {
      const adapter = createLoraAdapter(base, { rank: 2, alpha: 4 }, 1);
      adapter.layers[1]!.up!.b[0] = value;
      const err = await importAdapter(store, {
        model: latest,
        baseConfig: base.config,
        files: adapterToFiles(adapter),
      }).then(
        () => undefined,
        (e: unknown) => e,
      );
      expect(err).toBeInstanceOf(InvalidInputError);
      expect(err).toMatchObject({ param: name, code: "invalid_adapter" });
    }
    expect(await store.blobs.list("checkpoints/")).toEqual(before);
    expect((await store.models.get("e", model.id))!.latest_step).toBe(latest.latest_step);
  });

  it("when the upload's client has gone (its signal aborted), then the check stops and nothing is stored", async () => {
    const before = await store.blobs.list("checkpoints/");
    const latest = (await store.models.get("e", model.id))!;
    const gone = new AbortController();
    const pending = importAdapter(store, {
      model: latest,
      baseConfig: base.config,
      files: adapterFiles(),
      signal: gone.signal,
    });
    gone.abort(new Error("the client went away"));
    await expect(pending).rejects.toThrow("the client went away");
    expect(await store.blobs.list("checkpoints/")).toEqual(before);
    expect((await store.models.get("e", model.id))!.latest_step).toBe(latest.latest_step);
  });
});
