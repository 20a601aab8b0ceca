import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import { mkdir, mkdtemp, readdir, readFile, rm, stat, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type HubStandin, shippedModelFiles, startHubStandin } from "../../test/hub-standin.ts";
import { checkModelFolder, scanBaseModels } from "./folders.ts";
import {
  HubError,
  type PullEvent,
  type PullManifest,
  type PullOptions,
  parseRepoArgument,
  pullModel,
} from "./hub.ts";
import { readSafetensors, saveSafetensors } from "./safetensors.ts";

const tiny = shippedModelFiles();
const WEIGHTS = tiny["model.safetensors"]!;
const sha256 = (bytes: Uint8Array) => createHash("sha256").update(bytes).digest("hex");
const TOKEN = "hf_granted";

/** tiny-chat's weights split into two shards, with the index transformers writes. */
function sharded(): Record<string, Buffer> {
  const { tensors } = readSafetensors(WEIGHTS);
  const names = [...tensors.keys()].sort();
  const halves = [names.slice(0, names.length / 2), names.slice(names.length / 2)];
  const files: Record<string, Buffer> = {};
  const weightMap: Record<string, string> = {};
  halves.forEach((half, i) => {
    const shard = `model-0000${i + 1}-of-00002.safetensors`;
    const map = new Map(half.map((n) => [n, tensors.get(n)!]));
    files[shard] = Buffer.from(saveSafetensors(map, { format: "pt" }, "F32"));
    for (const n of half) weightMap[n] = shard;
  });
  files["model.safetensors.index.json"] = Buffer.from(
    JSON.stringify({ metadata: { total_size: WEIGHTS.length }, weight_map: weightMap }),
  );
  const { "model.safetensors": _, ...rest } = tiny;
  return { ...rest, ...files };
}

const config = JSON.parse(tiny["config.json"]!.toString()) as Record<string, unknown>;
const withConfig = (edit: Record<string, unknown>) => ({
  ...tiny,
  "config.json": Buffer.from(JSON.stringify({ ...config, ...edit })),
});

let hub: HubStandin;
let root: string;
let modelsDir: string;
beforeAll(async () => {
  hub = await startHubStandin({
    repos: [
      {
        id: "acme/tiny-chat",
        refs: {
          main: {
            ...tiny,
            "README.md": "# tiny-chat\n",
            "generation_config.json": JSON.stringify({ eos_token_id: [767, 765] }),
            "onnx/model.onnx": "not fetched",
          },
          "v1.0": withConfig({ max_position_embeddings: 128 }),
        },
      },
      { id: "acme/cut", refs: { main: tiny } },
      { id: "acme/cut-once", refs: { main: tiny } },
      { id: "acme/liar", refs: { main: tiny } },
      { id: "acme/sharded", refs: { main: sharded() } },
      { id: "acme/gated", refs: { main: tiny }, gated: true },
      {
        id: "acme/pickled",
        refs: {
          main: {
            "config.json": tiny["config.json"]!,
            "tokenizer.json": tiny["tokenizer.json"]!,
            "pytorch_model.bin": "pickle",
          },
        },
      },
      { id: "acme/gemma", refs: { main: withConfig({ model_type: "gemma3" }) } },
      { id: "acme/unlisted", refs: { main: tiny } },
    ],
    tokens: { [TOKEN]: ["acme/gated"], hf_other: [] },
    renamed: { "acme/old-name": "acme/cut-once" },
  });
  root = await mkdtemp(join(tmpdir(), "arbor-hub-"));
  modelsDir = join(root, "models");
});
afterAll(async () => {
  await hub?.close();
  await rm(root, { recursive: true, force: true });
});

/** A pull from the stand-in, retrying at once. */
function pull(repo: string, more: Partial<PullOptions> = {}, events: PullEvent[] = []) {
  return pullModel({
    repo,
    endpoint: hub.endpoint,
    modelsDir,
    retryDelay: () => 0,
    onEvent: (e) => events.push(e),
    ...more,
  });
}

/** What a failed pull left: the final folder (must not exist) and the staging folder. */
function leftBehind(id: string) {
  return {
    final: existsSync(join(modelsDir, ...id.split("/"))),
    staging: existsSync(join(modelsDir, ".pulls", ...id.split("/"))),
  };
}

const requestsFor = (file: string) => hub.requests.filter((r) => r.file === file);

describe("arbor models pull, against a stand-in Hub", () => {
  it("when a repo is pulled, then its config, tokenizer and safetensors arrive byte for byte, verified, and the manifest pins the commit", async () => {
    const events: PullEvent[] = [];
    const result = await pull("acme/tiny-chat", { token: TOKEN }, events);
    const dir = join(modelsDir, "acme", "tiny-chat");
    expect(result).toMatchObject({ id: "acme/tiny-chat", dir, existing: false });
    expect((await readdir(dir)).sort()).toEqual(
      [
        "arbor-pull.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
      ].sort(),
    );
    for (const name of ["config.json", "tokenizer.json", "model.safetensors"])
      expect(sha256(await readFile(join(dir, name)))).toBe(sha256(tiny[name]!));
    const manifest = JSON.parse(
      await readFile(join(dir, "arbor-pull.json"), "utf8"),
    ) as PullManifest;
    expect(manifest).toMatchObject({
      repo_id: "acme/tiny-chat",
      revision: "main",
      commit: hub.commit("acme/tiny-chat"),
      endpoint: hub.endpoint,
    });
    expect(manifest.files.find((f) => f.path === "model.safetensors")).toEqual({
      path: "model.safetensors",
      size: WEIGHTS.length,
      sha256: sha256(WEIGHTS),
      lfs: true,
    });
    expect(manifest.files.find((f) => f.path === "config.json")).toMatchObject({
      sha256: sha256(tiny["config.json"]!),
      git_blob_id: expect.stringMatching(/^[0-9a-f]{40}$/),
      lfs: false,
    });
    expect(result.fetched).toBe(manifest.files.reduce((sum, f) => sum + f.size, 0));
    // Every file was asked for at the pinned commit; the weights came from the CDN after the
    // redirect, which never saw the token.
    const commit = hub.commit("acme/tiny-chat");
    const hubFiles = hub.requests.filter(
      (r) => r.server === "hub" && r.url.startsWith("/acme/tiny-chat/resolve/"),
    );
    expect(hubFiles.every((r) => r.url.includes(`/resolve/${commit}/`))).toBe(true);
    expect(hubFiles.every((r) => r.authorization === `Bearer ${TOKEN}`)).toBe(true);
    const cdn = requestsFor("acme/tiny-chat/model.safetensors").filter((r) => r.server === "cdn");
    expect(cdn).toHaveLength(1);
    expect(cdn[0]).toMatchObject({ status: 200 });
    expect(cdn[0]!.authorization).toBeUndefined();
    expect(hub.requests.some((r) => r.url.includes("README.md") || r.url.includes("onnx"))).toBe(
      false,
    );
    expect(events[0]).toEqual({ type: "resolved", revision: "main", commit });
    expect(events.find((e) => e.type === "checked")).toMatchObject({
      files: ["model.safetensors"],
      bytes: WEIGHTS.length,
      parameters: 836736,
    });
    expect(events.at(-1)).toMatchObject({
      type: "file",
      path: "model.safetensors",
      state: "fetched",
    });
    // The server serves it; nothing of the staging is left to be mistaken for a model.
    const { models, skipped } = await scanBaseModels(modelsDir);
    expect(models.map((m) => m.id)).toContain("acme/tiny-chat");
    expect(skipped).toEqual([]);
    expect(existsSync(join(modelsDir, ".pulls"))).toBe(false);
  });

  it("when the same repo and commit are pulled again, then the folder is answered as it is; another repo under that id is refused", async () => {
    const before = hub.requests.length;
    const again = await pull("acme/tiny-chat");
    expect(again).toMatchObject({ existing: true, fetched: 0, id: "acme/tiny-chat" });
    expect(hub.requests.slice(before).every((r) => r.url.startsWith("/api/"))).toBe(true);
    await expect(pull("acme/cut-once", { id: "acme/tiny-chat" })).rejects.toMatchObject({
      kind: "exists",
      message: expect.stringMatching(/acme\/tiny-chat already exists/),
    });
    await expect(pull("acme/cut-once", { id: "arbor/tiny-chat" })).rejects.toMatchObject({
      kind: "exists",
      message: expect.stringMatching(/shipped with Arbor/),
    });
  });

  it("when a tag is asked for, under another id, then the tag's commit and files are what arrive", async () => {
    const result = await pull("acme/tiny-chat", { revision: "v1.0", id: "acme/tiny-chat-v1" });
    expect(result.manifest).toMatchObject({
      revision: "v1.0",
      commit: hub.commit("acme/tiny-chat", "v1.0"),
    });
    expect(hub.commit("acme/tiny-chat", "v1.0")).not.toBe(hub.commit("acme/tiny-chat"));
    expect(result.config.maxPositions).toBe(128);
    await expect(pull("acme/tiny-chat", { revision: "v9", id: "acme/v9" })).rejects.toMatchObject({
      kind: "not_found",
      param: "revision",
      message: expect.stringMatching(/no revision "v9"/),
    });
  });

  it("when a download is cut off once, then it goes on from where it stopped, with Range, in the same run", async () => {
    const file = "acme/cut-once/model.safetensors";
    hub.cut(file, 1_000_000, 1);
    const events: PullEvent[] = [];
    const result = await pull("acme/cut-once", {}, events);
    expect(sha256(await readFile(join(result.dir, "model.safetensors")))).toBe(sha256(WEIGHTS));
    const cdn = requestsFor(file).filter((r) => r.server === "cdn");
    expect(cdn.map((r) => r.range)).toEqual([undefined, expect.stringMatching(/^bytes=\d+-/)]);
    const resumedAt = Number(/^bytes=(\d+)-/.exec(cdn[1]!.range!)![1]);
    expect(resumedAt).toBeGreaterThan(0);
    expect(resumedAt).toBeLessThanOrEqual(1_000_000);
    expect(events).toContainEqual(
      expect.objectContaining({ type: "retry", path: "model.safetensors", attempt: 1 }),
    );
  });

  it("when a download keeps being cut off, then the pull fails leaving the partial file, and the next run resumes it without fetching anything twice", async () => {
    const file = "acme/cut/model.safetensors";
    hub.cut(file, 1_000_000, 2);
    const first = pull("acme/cut", { retries: 1 });
    await expect(first).rejects.toMatchObject({
      kind: "network",
      message: expect.stringMatching(
        /model\.safetensors: the download kept failing .*pull again to resume/,
      ),
    });
    expect(leftBehind("acme/cut")).toEqual({ final: false, staging: true });
    const partial = join(modelsDir, ".pulls", "acme", "cut", ".partial", sha256(WEIGHTS));
    const kept = (await stat(partial)).size;
    expect(kept).toBeGreaterThan(0);
    expect(kept).toBeLessThan(WEIGHTS.length);

    const before = hub.requests.length;
    const servedBefore = { weights: hub.served(file), config: hub.served("acme/cut/config.json") };
    const result = await pull("acme/cut");
    expect(sha256(await readFile(join(result.dir, "model.safetensors")))).toBe(sha256(WEIGHTS));
    // The second run asked for the rest only, and took the verified config and tokenizer as
    // they were.
    const second = hub.requests.slice(before).filter((r) => r.file === file && r.server === "cdn");
    expect(second.map((r) => r.range)).toEqual([`bytes=${kept}-${WEIGHTS.length - 1}`]);
    expect(hub.served(file) - servedBefore.weights).toBe(WEIGHTS.length - kept);
    expect(hub.served("acme/cut/config.json")).toBe(servedBefore.config);
    expect(result.fetched).toBe(WEIGHTS.length - kept);
    expect(leftBehind("acme/cut")).toEqual({ final: true, staging: false });
  });

  it("when the bytes do not match the Hub's SHA-256, then the pull is refused and nothing is left behind", async () => {
    hub.lie("acme/liar/model.safetensors", "0".repeat(64));
    const error = await pull("acme/liar").catch((e: unknown) => e);
    expect(error).toBeInstanceOf(HubError);
    expect(error).toMatchObject({
      kind: "checksum",
      message: expect.stringMatching(
        new RegExp(
          `model\\.safetensors: its SHA-256 is ${sha256(WEIGHTS)}, but the Hub says 0{64}`,
        ),
      ),
    });
    expect(leftBehind("acme/liar")).toEqual({ final: false, staging: false });
    expect(existsSync(join(modelsDir, ".pulls"))).toBe(false);
  });

  it("when a repo is gated, then without HF_TOKEN, or with a token not granted it, the error says to accept its terms and set HF_TOKEN; with one granted, it is pulled", async () => {
    await expect(pull("acme/gated")).rejects.toMatchObject({
      kind: "access",
      message: expect.stringMatching(
        new RegExp(
          `acme/gated is gated .*accept its terms at ${hub.endpoint}/acme/gated .*set HF_TOKEN`,
        ),
      ),
    });
    expect(
      hub.requests.filter((r) => r.url.startsWith("/acme/gated/resolve/")).map((r) => r.status),
    ).toEqual([401]);
    await expect(pull("acme/gated", { token: "hf_other" })).rejects.toMatchObject({
      kind: "access",
      message: expect.stringMatching(
        /token in HF_TOKEN has no access to it yet .*accept its terms/,
      ),
    });
    await expect(pull("acme/gated", { token: "hf_unknown" })).rejects.toMatchObject({
      kind: "access",
      message: expect.stringMatching(/refused the token in HF_TOKEN as invalid/),
    });
    // Refused at its first file: no staging folder is left either.
    expect(leftBehind("acme/gated")).toEqual({ final: false, staging: false });
    const result = await pull("acme/gated", { token: TOKEN });
    expect(result.manifest.repo_id).toBe("acme/gated");
  });

  it("when a repo has its weights only as pickles, then it is refused, naming them, before any file is fetched", async () => {
    await expect(pull("acme/pickled")).rejects.toMatchObject({
      kind: "refused",
      message: expect.stringMatching(
        /acme\/pickled has its weights only as pickles \(pytorch_model\.bin\), which can run code when loaded/,
      ),
    });
    expect(hub.requests.some((r) => r.url.startsWith("/acme/pickled/resolve/"))).toBe(false);
    expect(leftBehind("acme/pickled")).toEqual({ final: false, staging: false });
  });

  it("when config.json names an architecture the engine does not compute, then it is refused with the reason before any safetensors byte is asked for", async () => {
    await expect(pull("acme/gemma")).rejects.toMatchObject({
      kind: "refused",
      message: expect.stringMatching(
        /acme\/gemma cannot be served by Arbor's engine: config\.json: model_type "gemma3" is not supported/,
      ),
    });
    const asked = hub.requests.filter((r) => r.url.startsWith("/acme/gemma/resolve/"));
    expect(asked.some((r) => r.url.endsWith("/config.json"))).toBe(true);
    expect(asked.some((r) => r.url.includes("safetensors"))).toBe(false);
    expect(requestsFor("acme/gemma/model.safetensors")).toEqual([]);
    expect(leftBehind("acme/gemma")).toEqual({ final: false, staging: false });
  });

  it("when the weights are shards, then the index and each shard it names arrive and the folder loads", async () => {
    const result = await pull("acme/sharded");
    expect(result.manifest.files.map((f) => f.path).sort()).toEqual(
      [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
      ].sort(),
    );
    await expect(checkModelFolder(result.dir)).resolves.toMatchObject({ parameters: 836736 });
  });

  it("when the listing gives no sizes or digests, then each file's answer stands in: X-Linked-Etag and X-Linked-Size, or the ETag (git blob id) and Content-Length", async () => {
    hub.listWithoutBlobs = true;
    try {
      const result = await pull("acme/unlisted");
      const files = new Map(result.manifest.files.map((f) => [f.path, f]));
      expect(files.get("model.safetensors")).toMatchObject({
        size: WEIGHTS.length,
        sha256: sha256(WEIGHTS),
        lfs: true,
      });
      expect(files.get("config.json")).toMatchObject({
        size: tiny["config.json"]!.length,
        git_blob_id: expect.stringMatching(/^[0-9a-f]{40}$/),
      });
    } finally {
      hub.listWithoutBlobs = false;
    }
  });

  it("when the repo was renamed, then the Hub's relative redirects are followed with the token, and the headers of its last answer before the CDN are what is checked", async () => {
    const before = hub.requests.length;
    const result = await pull("acme/old-name", { id: "acme/renamed", token: TOKEN });
    expect(result.manifest).toMatchObject({
      repo_id: "acme/old-name",
      commit: hub.commit("acme/cut-once"),
    });
    const seen = hub.requests.slice(before);
    const moved = seen.filter((r) => r.status === 307);
    expect(moved.map((r) => r.url.split("/").slice(0, 5).join("/"))).toContain(
      "/api/models/acme/old-name",
    );
    expect(moved.filter((r) => r.url.startsWith("/acme/old-name/resolve/"))).toHaveLength(4);
    expect(
      seen.filter((r) => r.server === "hub").every((r) => r.authorization === `Bearer ${TOKEN}`),
    ).toBe(true);
    expect(seen.filter((r) => r.server === "cdn").every((r) => !r.authorization)).toBe(true);
  });

  it("when the repo or id is malformed, or the repo is not on the Hub, then the error says which", async () => {
    await expect(pull("tiny-chat")).rejects.toMatchObject({ kind: "invalid", param: "repo_id" });
    await expect(pull("acme/tiny-chat", { id: "x" })).rejects.toMatchObject({
      kind: "invalid",
      param: "id",
    });
    await expect(pull("acme/nothing")).rejects.toMatchObject({
      kind: "not_found",
      message: expect.stringMatching(/acme\/nothing was not found .*set HF_TOKEN/),
    });
  });

  it("when a pull of the same id is under way, then a second one is refused", async () => {
    const lockFile = join(modelsDir, ".pulls", "acme", "busy.lock");
    await mkdir(join(modelsDir, ".pulls", "acme"), { recursive: true });
    await writeFile(lockFile, `${process.pid}\n`);
    await expect(pull("acme/cut-once", { id: "acme/busy" })).rejects.toMatchObject({
      kind: "busy",
      message: expect.stringMatching(/A pull into acme\/busy is under way/),
    });
    // A lock whose process is gone is taken over.
    await writeFile(lockFile, "999999999\n");
    await expect(pull("acme/cut-once", { id: "acme/busy" })).resolves.toMatchObject({
      id: "acme/busy",
    });
    expect(existsSync(lockFile)).toBe(false);
  });
});

describe("the argument of arbor models pull", () => {
  it("when it names a revision, then it is split at the @", () => {
    expect(parseRepoArgument("acme/m")).toEqual({ repo: "acme/m", revision: undefined });
    expect(parseRepoArgument("acme/m@refs/pr/1")).toEqual({
      repo: "acme/m",
      revision: "refs/pr/1",
    });
  });
});
