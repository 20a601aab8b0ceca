import { createHash, type Hash } from "node:crypto";
import {
  mkdir,
  open,
  readdir,
  readFile,
  rename,
  rm,
  rmdir,
  stat,
  writeFile,
} from "node:fs/promises";
import { dirname, join } from "node:path";
import { listCatalog } from "./catalog.ts";
import type { ModelConfig } from "./config.ts";
import { checkModelFolder } from "./folders.ts";
import type { WeightChoice } from "./model.ts";
import { ModelFileError } from "./tokenizer.ts";

/**
 * Pulls a model from the Hugging Face Hub (or anything that speaks its HTTP API) into the
 * base-models directory, as `arbor models pull` and the server's `pullBaseModel` do:
 *
 * 1. `GET {endpoint}/api/models/{repo}/revision/{revision}?blobs=true` pins the revision to a
 *    commit (`sha`) and lists the files (`siblings`: `rfilename`, `size`, `blobId`, and for
 *    LFS files `lfs.sha256`).
 * 2. The config, tokenizer and generation files arrive first, into a staging folder
 *    (`<modelsDir>/.pulls/<owner>/<name>`), and are checked as the engine would load them, less
 *    the weights: a model it cannot serve is refused before any weight is fetched.
 * 3. The safetensors (one file, or the shards `model.safetensors.index.json` names) follow.
 *    Pickles (`*.bin`, `*.pt`, …) are never fetched: a repo with only those is refused.
 * 4. Each file comes from `GET {endpoint}/{repo}/resolve/{commit}/{path}`, redirects followed
 *    (the token is sent to the endpoint's origin only, never to a CDN it redirects to), and is
 *    verified: LFS files by their SHA-256, the others by their git blob id. A cut connection
 *    is taken up again with `Range`; a later run does the same with what an earlier one left.
 * 5. The whole folder is checked as the server would serve it, a manifest (`arbor-pull.json`:
 *    repo, revision, commit, endpoint, each file's size and SHA-256) is written, and the staging
 *    folder is renamed to `<modelsDir>/<owner>/<name>`: nothing half-written ever appears there.
 */

/** The Hub's own default, as `HF_ENDPOINT` overrides it. */
export const DEFAULT_HUB_ENDPOINT = "https://huggingface.co";

/** The manifest a pulled folder holds. */
export const PULL_MANIFEST = "arbor-pull.json";

/** `<owner>/<name>`, as base model ids are written (the spec's grammar). */
const BASE_MODEL_ID = /^(?!\.\.?\/)[A-Za-z0-9._-]{1,128}\/(?!\.\.?$)[A-Za-z0-9._-]{1,128}$/;

/** A Hub repo id: `<owner>/<name>`, each starting and ending with a letter or digit, no `--`
 * or `..` (the Hub's own rule). */
const REPO_ID =
  /^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?\/[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$/;

/** The files besides the weights that a model folder is served with. config.json and
 * tokenizer.json are required (the check names what is missing); the rest when present. The
 * chat template is read as transformers' tokenizer reads it: `chat_template.jinja`, else
 * `tokenizer_config.json`'s; `chat_template.json` is a multimodal processor's file, which a
 * tokenizer never reads, so it is not fetched. */
const METADATA_FILES = [
  "config.json",
  "generation_config.json",
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "chat_template.jinja",
] as const;

const SAFETENSORS = "model.safetensors";
const SAFETENSORS_INDEX = "model.safetensors.index.json";

/** Weights in Python's pickle format, which can run code when loaded: never fetched. */
const PICKLE = /\.(bin|pt|pth|pkl|ckpt)$/i;

/** How a pull failed: what a server answers depends on it. */
export type HubErrorKind =
  /** The repo or revision does not exist (or is private and the token cannot see it). */
  | "not_found"
  /** Gated or private: no token, or one without access. */
  | "access"
  /** The model is there, but the engine cannot serve it (or it has only pickles). */
  | "refused"
  /** A file's bytes do not match the Hub's SHA-256 or git blob id. */
  | "checksum"
  /** The Hub or its CDN could not be reached, or kept failing; a later run resumes. */
  | "network"
  /** The id is taken (by another folder, or a shipped model). */
  | "exists"
  /** Another pull into the id is under way. */
  | "busy"
  /** An argument is not of its form. */
  | "invalid";

export class HubError extends Error {
  override name = "HubError";
  readonly kind: HubErrorKind;
  /** Which argument it is about: `repo_id`, `revision` or `id`. */
  readonly param: string | undefined;
  constructor(kind: HubErrorKind, message: string, param?: string) {
    super(message);
    this.kind = kind;
    this.param = param;
  }
}

/** Where the Hub is and who asks (`HF_ENDPOINT`, `HF_TOKEN`: `readConfig` reads them as the
 * Hub's own tools do). */
export interface HubAccess {
  /** Default https://huggingface.co. */
  endpoint: string;
  /** Sent as `Authorization: Bearer …` to the endpoint's origin, never elsewhere. */
  token?: string | undefined;
}

/** `owner/name[@revision]`, as `arbor models pull` takes it. */
export function parseRepoArgument(text: string): { repo: string; revision: string | undefined } {
  const at = text.indexOf("@");
  return at < 0
    ? { repo: text, revision: undefined }
    : { repo: text.slice(0, at), revision: text.slice(at + 1) };
}

export interface PulledFile {
  path: string;
  size: number;
  sha256: string;
  /** The git blob id the Hub lists for a file kept in git (not LFS). */
  git_blob_id?: string;
  lfs: boolean;
}

/** `arbor-pull.json`: where the folder came from, pinned. */
export interface PullManifest {
  repo_id: string;
  /** The revision asked for (a branch, tag or commit). */
  revision: string;
  /** The commit it was resolved to, which every file was fetched at. */
  commit: string;
  endpoint: string;
  /** When the pull finished (ISO 8601). */
  pulled_at: string;
  files: PulledFile[];
}

/** What a pull reports as it goes. */
export type PullEvent =
  /** The revision's commit, which every file is fetched at. */
  | { type: "resolved"; revision: string; commit: string }
  /** The engine accepted the config and tokenizer files: the weights come next. */
  | { type: "checked"; config: ModelConfig; parameters: number; files: string[]; bytes: number }
  | {
      type: "progress";
      path: string;
      /** This file's bytes on disk so far, and its size. */
      done: number;
      size: number;
      /** Every file's bytes so far (those skipped and resumed included), and their sum. */
      allDone: number;
      allSize: number;
    }
  | { type: "file"; path: string; size: number; fetched: number; state: "fetched" | "kept" }
  | { type: "retry"; path: string; attempt: number; reason: string };

export interface PullOptions extends HubAccess {
  /** `owner/name` on the Hub. */
  repo: string;
  /** A branch, tag or commit; default `main`. */
  revision?: string | undefined;
  /** The base model id to put it under; default the repo id. */
  id?: string | undefined;
  /** `ARBOR_BASE_MODELS_DIR`. */
  modelsDir: string;
  /** How the engine will keep the weights (what fits depends on it); default auto. */
  weights?: WeightChoice | undefined;
  /** Attempts after the first when a download is cut off or answered 429/5xx; default 4. */
  retries?: number;
  /** The wait before the n-th retry (1-based), in ms; default 0.5 s doubling to 8 s. */
  retryDelay?: (attempt: number) => number;
  onEvent?: (event: PullEvent) => void;
  signal?: AbortSignal;
}

export interface PullResult {
  id: string;
  dir: string;
  manifest: PullManifest;
  config: ModelConfig;
  parameters: number;
  /** Bytes fetched by this pull (0 when the folder was there already). */
  fetched: number;
  /** The folder was already there, pulled from the same repo at the same commit. */
  existing: boolean;
}

/** A file of the repo as the listing gives it. */
interface Sibling {
  rfilename: string;
  size?: number;
  blobId?: string;
  lfs?: { sha256?: string; size?: number };
}

/** A file to fetch, and how to check it. */
interface Planned {
  path: string;
  /** From the listing; else from the Hub's headers on the file's answer. */
  size: number | undefined;
  sha256: string | undefined;
  blobId: string | undefined;
  lfs: boolean;
}

const USER_AGENT = "arbor-models-pull";

/** Pulls `repo` at `revision` into `<modelsDir>/<id>`; see the module's comment. */
export async function pullModel(options: PullOptions): Promise<PullResult> {
  const { repo, modelsDir } = options;
  const revision = options.revision || "main";
  const id = options.id ?? repo;
  const endpoint = options.endpoint.replace(/\/+$/, "");
  if (!REPO_ID.test(repo))
    throw new HubError(
      "invalid",
      `The repo id must be "<owner>/<name>" as the Hub writes it, got ${JSON.stringify(repo)}.`,
      "repo_id",
    );
  if (!BASE_MODEL_ID.test(id))
    throw new HubError(
      "invalid",
      `The id must be "<owner>/<name>", got ${JSON.stringify(id)}.`,
      "id",
    );
  // What git refuses in a ref name, and control characters.
  if (revision.length > 255 || /[\s~^:?*[\\]/.test(revision) || [...revision].some((c) => c < " "))
    throw new HubError("invalid", `Not a revision: ${JSON.stringify(revision)}.`, "revision");
  const hub = new HubClient({ ...options, endpoint, revision });
  const target = join(modelsDir, ...id.split("/"));

  const info = await hub.revisionInfo();
  const commit = info.sha;
  options.onEvent?.({ type: "resolved", revision, commit });
  const siblings = new Map(info.siblings.map((s) => [s.rfilename, s]));
  const existing = await existingPull(target, id, repo, commit, options.weights ?? "auto");
  if (existing) return existing;
  if (listCatalog().some((m) => m.id === id))
    throw new HubError(
      "exists",
      `${id} is a model shipped with Arbor: pull under another id.`,
      "id",
    );
  if (await stat(target).catch(() => undefined))
    throw new HubError(
      "exists",
      `${id} already exists at ${target}: remove it first, or pull under another id.`,
      "id",
    );

  // What the weights are, from the listing alone: a repo without safetensors is refused here.
  const sharded = siblings.has(SAFETENSORS_INDEX);
  if (!sharded && !siblings.has(SAFETENSORS)) {
    const pickles = [...siblings.keys()].filter((f) => !f.includes("/") && PICKLE.test(f));
    throw new HubError(
      "refused",
      pickles.length > 0
        ? `${repo} has its weights only as pickles (${pickles.slice(0, 3).join(", ")}), which can run code when loaded: Arbor reads safetensors only. Look for a safetensors version of the model.`
        : `${repo} has no ${SAFETENSORS} (nor ${SAFETENSORS_INDEX}) at ${commit}: Arbor reads safetensors weights only.`,
      "repo_id",
    );
  }
  if (!siblings.has("config.json"))
    throw new HubError("refused", `${repo} has no config.json at ${commit}.`, "repo_id");

  const staging = join(modelsDir, ".pulls", ...id.split("/"));
  const release = await lock(`${staging}.lock`, id, modelsDir);
  try {
    await mkdir(staging, { recursive: true });
    // What an earlier run left of files this commit does not have goes; the rest is verified
    // again before it is kept.
    await prune(staging, new Set([...siblings.keys(), PARTIAL]));
    const metadata = METADATA_FILES.filter((f) => siblings.has(f)).map((f) =>
      planned(siblings.get(f)!),
    );
    if (sharded) metadata.push(planned(siblings.get(SAFETENSORS_INDEX)!));
    const files: PulledFile[] = [];
    let fetched = 0;
    const progress = new Progress(options.onEvent);
    progress.add(metadata);
    for (const file of metadata) {
      const got = await hub.download(file, commit, staging, progress);
      files.push(got.file);
      fetched += got.fetched;
    }

    // The engine's verdict on what it has so far: refused here, the weights are never fetched.
    const weights = options.weights ?? "auto";
    let precheck: Awaited<ReturnType<typeof checkModelFolder>>;
    try {
      precheck = await checkModelFolder(staging, { weights, tensors: false });
    } catch (err) {
      await removeStaging(staging, modelsDir);
      throw refusal(repo, staging, err);
    }
    const shards = sharded
      ? await shardsOf(join(staging, SAFETENSORS_INDEX), repo, siblings)
      : [SAFETENSORS];
    const weightFiles = shards.map((s) => planned(siblings.get(s)!));
    progress.add(weightFiles);
    options.onEvent?.({
      type: "checked",
      config: precheck.config,
      parameters: precheck.parameters,
      files: shards,
      bytes: weightFiles.reduce((sum, f) => sum + (f.size ?? 0), 0),
    });
    for (const file of weightFiles) {
      const got = await hub.download(file, commit, staging, progress);
      files.push(got.file);
      fetched += got.fetched;
    }

    await prune(staging, new Set([...files.map((f) => f.path)]));
    let checked: Awaited<ReturnType<typeof checkModelFolder>>;
    try {
      checked = await checkModelFolder(staging, { weights });
    } catch (err) {
      await removeStaging(staging, modelsDir);
      throw refusal(repo, staging, err);
    }
    const manifest: PullManifest = {
      repo_id: repo,
      revision,
      commit,
      endpoint,
      pulled_at: new Date().toISOString(),
      files,
    };
    await writeFile(join(staging, PULL_MANIFEST), `${JSON.stringify(manifest, null, 2)}\n`);
    await mkdir(dirname(target), { recursive: true });
    try {
      await rename(staging, target);
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === "ENOTEMPTY" || code === "EEXIST")
        throw new HubError("exists", `${id} appeared at ${target} during the pull.`, "id");
      throw err;
    }
    await removeEmpty(dirname(staging), modelsDir);
    return { id, dir: target, manifest, ...checked, fetched, existing: false };
  } catch (err) {
    // A file that does not match the Hub's checksum leaves nothing worth resuming, and a refused
    // model nothing at all; a network failure leaves what arrived, for the next run.
    if (err instanceof HubError && (err.kind === "checksum" || err.kind === "refused"))
      await removeStaging(staging, modelsDir);
    else if (await holdsNothing(staging)) await removeStaging(staging, modelsDir);
    throw err;
  } finally {
    await release();
  }
}

/** Partial downloads, named by the digest they are expected to have, inside the staging folder. */
const PARTIAL = ".partial";

/** What the listing says of a file; a digest or size not of its form counts as unsaid (the
 * Hub's headers on the file's answer then stand in, checked alike). */
function planned(s: Sibling): Planned {
  const hex = (value: unknown, length: number) =>
    typeof value === "string" && new RegExp(`^[0-9a-f]{${length}}$`).test(value.toLowerCase())
      ? value.toLowerCase()
      : undefined;
  const sha256 = hex(s.lfs?.sha256, 64);
  const size = s.lfs?.size ?? s.size;
  return {
    path: s.rfilename,
    size: Number.isSafeInteger(size) && size! >= 0 ? size : undefined,
    sha256,
    blobId: sha256 ? undefined : hex(s.blobId, 40),
    lfs: typeof s.lfs === "object" && s.lfs !== null,
  };
}

/** The shards a safetensors index names, each of which the listing must hold. */
async function shardsOf(
  indexPath: string,
  repo: string,
  siblings: Map<string, Sibling>,
): Promise<string[]> {
  let map: unknown;
  try {
    map = (JSON.parse(await readFile(indexPath, "utf8")) as { weight_map?: unknown }).weight_map;
  } catch (err) {
    throw new HubError(
      "refused",
      `${repo}'s ${SAFETENSORS_INDEX} is not valid JSON (${(err as Error).message}).`,
      "repo_id",
    );
  }
  const shards =
    typeof map === "object" && map !== null
      ? [...new Set(Object.values(map as Record<string, unknown>))]
      : [];
  if (
    shards.length === 0 ||
    !shards.every((s) => typeof s === "string" && s.endsWith(".safetensors"))
  )
    throw new HubError(
      "refused",
      `${repo}'s ${SAFETENSORS_INDEX} names no safetensors shards in its weight_map.`,
      "repo_id",
    );
  const missing = (shards as string[]).filter((s) => s.includes("/") || !siblings.has(s));
  if (missing.length > 0)
    throw new HubError(
      "refused",
      `${repo}'s ${SAFETENSORS_INDEX} names shards the repo does not hold: ${missing.join(", ")}.`,
      "repo_id",
    );
  return (shards as string[]).sort();
}

/** The engine's refusal, naming the file by its name in the repo rather than in staging. */
function refusal(repo: string, staging: string, err: unknown): unknown {
  if (!(err instanceof ModelFileError)) return err;
  const why = err.message.split(`${staging}/`).join("");
  return new HubError("refused", `${repo} cannot be served by Arbor's engine: ${why}.`, "repo_id");
}

/** The folder at `target` when it was pulled from `repo` at `commit` (a repeated pull). */
async function existingPull(
  target: string,
  id: string,
  repo: string,
  commit: string,
  weights: WeightChoice,
): Promise<PullResult | undefined> {
  const text = await readFile(join(target, PULL_MANIFEST), "utf8").catch(() => undefined);
  if (text === undefined) return undefined;
  let manifest: PullManifest;
  try {
    manifest = JSON.parse(text) as PullManifest;
  } catch {
    return undefined;
  }
  if (manifest.repo_id !== repo || manifest.commit !== commit) return undefined;
  const checked = await checkModelFolder(target, { weights }).catch(() => undefined);
  if (!checked) return undefined;
  return { id, dir: target, manifest, ...checked, fetched: 0, existing: true };
}

/** Whether `dir` holds no byte worth resuming from (only empty files and folders). */
async function holdsNothing(dir: string): Promise<boolean> {
  const entries = await readdir(dir, { withFileTypes: true }).catch(() => []);
  for (const entry of entries) {
    const path = join(dir, entry.name);
    const empty = entry.isDirectory()
      ? await holdsNothing(path)
      : entry.isFile() && (await stat(path)).size === 0;
    if (!empty) return false;
  }
  return true;
}

/** Removes every entry of `dir` whose name is not in `keep`. */
async function prune(dir: string, keep: Set<string>): Promise<void> {
  for (const name of await readdir(dir).catch(() => [])) {
    if (!keep.has(name)) await rm(join(dir, name), { recursive: true, force: true });
  }
}

async function removeStaging(staging: string, modelsDir: string): Promise<void> {
  await rm(staging, { recursive: true, force: true });
  await removeEmpty(dirname(staging), modelsDir);
}

/** Removes `dir` and its parents up to (not including) `root` while they are empty. */
async function removeEmpty(dir: string, root: string): Promise<void> {
  while (dir.startsWith(root) && dir !== root) {
    const entries = await readdir(dir).catch(() => ["?"]);
    if (entries.length > 0) return;
    await rmdir(dir).catch(() => {});
    dir = dirname(dir);
  }
}

/**
 * Takes the lock file at `path` for this process: a pull into the same id by a live process
 * (this one included) is refused; a lock left by a process that is gone is taken over.
 */
async function lock(path: string, id: string, root: string): Promise<() => Promise<void>> {
  await mkdir(dirname(path), { recursive: true });
  for (let attempt = 0; ; attempt++) {
    try {
      const handle = await open(path, "wx");
      await handle.writeFile(`${process.pid}\n`);
      await handle.close();
      return async () => {
        await rm(path, { force: true });
        await removeEmpty(dirname(path), root);
      };
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== "EEXIST" || attempt > 0) throw err;
      const pid = Number((await readFile(path, "utf8").catch(() => "")).trim());
      if (Number.isInteger(pid) && pid > 0 && alive(pid))
        throw new HubError(
          "busy",
          `A pull into ${id} is under way (process ${pid}); wait for it, or remove ${path} if that process is not pulling.`,
          "id",
        );
      await rm(path, { force: true });
    }
  }
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === "EPERM";
  }
}

/** Sums what every file has on disk, for one progress line over the whole pull. */
class Progress {
  readonly #sizes = new Map<string, number>();
  readonly #done = new Map<string, number>();
  readonly #onEvent: ((event: PullEvent) => void) | undefined;
  constructor(onEvent: ((event: PullEvent) => void) | undefined) {
    this.#onEvent = onEvent;
  }
  get allSize(): number {
    let sum = 0;
    for (const size of this.#sizes.values()) sum += size;
    return sum;
  }
  add(files: Planned[]): void {
    for (const f of files) this.#sizes.set(f.path, f.size ?? 0);
  }
  set(path: string, done: number, size: number): void {
    this.#sizes.set(path, size);
    this.#done.set(path, done);
    let allDone = 0;
    for (const d of this.#done.values()) allDone += d;
    this.#onEvent?.({ type: "progress", path, done, size, allDone, allSize: this.allSize });
  }
  event(event: PullEvent): void {
    this.#onEvent?.(event);
  }
}

/** What the Hub says of a file in its last answer to a `resolve` before its CDN. */
interface ResolveHeaders {
  commit: string | null;
  /** `X-Linked-Etag` (an LFS file's SHA-256), else `ETag` (a git blob id), unquoted. */
  etag: string | null;
  linkedSize: number | null;
}

/** A download's answer, and what the Hub said of the file on the way. */
interface Answer {
  response: Response;
  hub: ResolveHeaders;
}

class HubClient {
  readonly #endpoint: string;
  readonly #origin: string;
  readonly #token: string | undefined;
  readonly #repo: string;
  readonly #revision: string;
  readonly #retries: number;
  readonly #retryDelay: (attempt: number) => number;
  readonly #signal: AbortSignal | undefined;

  constructor(options: PullOptions & { endpoint: string; revision: string }) {
    this.#endpoint = options.endpoint;
    let origin: string;
    try {
      origin = new URL(options.endpoint).origin;
    } catch {
      throw new HubError(
        "invalid",
        `HF_ENDPOINT is not a URL: ${JSON.stringify(options.endpoint)}.`,
      );
    }
    this.#origin = origin;
    this.#token = options.token || undefined;
    this.#repo = options.repo;
    this.#revision = options.revision;
    this.#retries = options.retries ?? 4;
    this.#retryDelay = options.retryDelay ?? ((n) => Math.min(8000, 500 * 2 ** (n - 1)));
    this.#signal = options.signal;
  }

  /** The commit the revision is at, and the files there. */
  async revisionInfo(): Promise<{ sha: string; siblings: Sibling[] }> {
    const url = `${this.#endpoint}/api/models/${this.#repo}/revision/${encodeURIComponent(this.#revision)}?blobs=true`;
    let response: Response | undefined;
    for (let attempt = 0; ; attempt++) {
      try {
        response = (await this.#following(url, { accept: "application/json" })).response;
      } catch (err) {
        if (attempt >= this.#retries) throw this.#unreachable(url, err);
        await this.#wait(attempt + 1);
        continue;
      }
      if (!transient(response.status) || attempt >= this.#retries) break;
      await response.body?.cancel();
      await this.#wait(attempt + 1);
    }
    if (!response.ok) throw await this.#failure(response, url, "revision");
    let body: { sha?: unknown; siblings?: unknown };
    try {
      body = (await response.json()) as typeof body;
    } catch (err) {
      throw new HubError("network", `${url} did not answer JSON (${(err as Error).message}).`);
    }
    if (
      typeof body.sha !== "string" ||
      !/^[0-9a-f]{40}$/i.test(body.sha) ||
      !Array.isArray(body.siblings)
    )
      throw new HubError("network", `${url} did not answer a commit and its files.`);
    const siblings = (body.siblings as Sibling[]).filter((s) => typeof s?.rfilename === "string");
    return { sha: body.sha.toLowerCase(), siblings };
  }

  /**
   * Fetches one file into `staging/<path>`, verified, resuming what an earlier run left in
   * `staging/.partial/`; a verified file already there is kept.
   */
  async download(
    file: Planned,
    commit: string,
    staging: string,
    progress: Progress,
  ): Promise<{ file: PulledFile; fetched: number }> {
    const final = join(staging, file.path);
    const url = `${this.#endpoint}/${this.#repo}/resolve/${commit}/${file.path.split("/").map(encodeURIComponent).join("/")}`;
    // Fetched and verified by an earlier run (at this commit, or another with the same file):
    // hashed again, and kept when it matches.
    if (known(file)) {
      const kept = await stat(final).catch(() => undefined);
      if (kept?.size === file.size) {
        const digests = await hashFile(final, file.size);
        if (matches(file, digests)) {
          progress.set(file.path, file.size, file.size);
          progress.event({
            type: "file",
            path: file.path,
            size: file.size,
            fetched: 0,
            state: "kept",
          });
          return { file: pulled(file, digests), fetched: 0 };
        }
      }
    }
    await rm(final, { force: true });

    let expected = file;
    /** The bytes on disk so far, and their hashes; known once the expected digest is. */
    let state: Download | undefined = known(file) ? await resume(staging, file) : undefined;
    let fetched = 0;
    let attempt = 0;
    let cut: unknown;
    while (!state || state.bytes < state.size) {
      if (attempt > 0) {
        if (attempt > this.#retries) throw this.#cutOff(file.path, cut, state);
        progress.event({ type: "retry", path: file.path, attempt, reason: reasonOf(cut) });
        await this.#wait(attempt);
      }
      attempt++;
      const from = state?.bytes ?? 0;
      let answer: Answer;
      try {
        answer = await this.#get(url, from, state?.size);
      } catch (err) {
        if (err instanceof HubError && err.kind !== "network") throw err;
        cut = err;
        continue;
      }
      const { response, hub } = answer;
      if (hub.commit && hub.commit.toLowerCase() !== commit) {
        await response.body?.cancel();
        throw new HubError(
          "network",
          `${url} answered for commit ${hub.commit}, not the pinned ${commit}.`,
        );
      }
      if (!state) {
        // The listing said nothing of this file: the Hub's headers stand in for it.
        expected = reconcile(expected, hub, response, url);
        state = await resume(staging, expected);
        if (state.bytes > 0) {
          // Resumable after all, but this answer is the whole file: ask again with a Range.
          await response.body?.cancel();
          attempt = 0;
          continue;
        }
      } else {
        reconcile(expected, hub, response, url);
      }
      if (from > 0 && response.status === 200) {
        // The server ignored the Range and sent the whole file: start over.
        Object.assign(state, await startHashes(state.path, state.size, 0));
      } else if (from > 0 && !rangeStartsAt(response, from)) {
        await response.body?.cancel();
        throw new HubError(
          "network",
          `${url} answered a Range from byte ${from} with another range.`,
        );
      }
      const handle = await open(state.path, "a");
      try {
        for await (const chunk of response.body ?? []) {
          const bytes = chunk as Uint8Array;
          if (state.bytes + bytes.length > state.size) {
            await rm(state.path, { force: true });
            throw new HubError(
              "checksum",
              `${file.path}: the download is longer than the ${state.size} bytes the Hub lists. Nothing was kept: pull again.`,
            );
          }
          await handle.write(bytes);
          state.sha256.update(bytes);
          state.sha1.update(bytes);
          state.bytes += bytes.length;
          fetched += bytes.length;
          progress.set(file.path, state.bytes, state.size);
        }
        cut =
          state.bytes < state.size
            ? `the answer ended at byte ${state.bytes} of ${state.size}`
            : undefined;
      } catch (err) {
        if (err instanceof HubError) throw err;
        // Cut off mid-file: what arrived stays in the partial file, and the rest is asked for.
        cut = err;
      } finally {
        await handle.close();
      }
    }
    const digests = { sha256: state.sha256.digest("hex"), sha1: state.sha1.digest("hex") };
    if (!matches(expected, digests)) {
      await rm(state.path, { force: true });
      throw new HubError(
        "checksum",
        expected.sha256
          ? `${file.path}: its SHA-256 is ${digests.sha256}, but the Hub says ${expected.sha256}. The download was corrupted (or the Hub's copy is); nothing was kept: pull again.`
          : `${file.path}: its git blob id is ${digests.sha1}, but the Hub says ${expected.blobId}. The download was corrupted (or the Hub's copy is); nothing was kept: pull again.`,
      );
    }
    await rename(state.path, final);
    progress.set(file.path, state.size, state.size);
    progress.event({ type: "file", path: file.path, size: state.size, fetched, state: "fetched" });
    return { file: pulled(expected, digests), fetched };
  }

  /** A file's GET, answered 2xx (a 4xx/5xx is thrown as a HubError), with what the Hub said of
   * the file before any redirect took it elsewhere. */
  async #get(url: string, from: number, size: number | undefined): Promise<Answer> {
    const headers: Record<string, string> = { "accept-encoding": "identity" };
    if (from > 0) headers.range = `bytes=${from}-${size !== undefined ? size - 1 : ""}`;
    const { response, at, hub } = await this.#following(url, headers);
    if (response.ok)
      return {
        response,
        hub: {
          commit: hub.get("x-repo-commit"),
          etag: unquote(hub.get("x-linked-etag") ?? hub.get("etag")),
          linkedSize: numberOr(hub.get("x-linked-size")),
        },
      };
    if (transient(response.status)) {
      await response.body?.cancel();
      throw new HubError("network", `${at} answered ${response.status}.`);
    }
    throw await this.#failure(response, at, "file");
  }

  /**
   * Follows redirects by hand: the token goes to the endpoint's origin only, and the headers of
   * the last answer from that origin (a renamed repo redirects within it; an LFS file leaves it
   * for a CDN) are the Hub's word on the file, as huggingface_hub reads them.
   */
  async #following(
    url: string,
    headers: Record<string, string>,
  ): Promise<{ response: Response; at: string; hub: Headers }> {
    let at = url;
    let hub = new Headers();
    for (let hops = 0; hops <= 10; hops++) {
      const response = await this.#fetch(at, headers);
      if (new URL(at).origin === this.#origin) hub = response.headers;
      const location = response.headers.get("location");
      if (response.status < 300 || response.status >= 400 || location === null)
        return { response, at, hub };
      await response.body?.cancel();
      at = new URL(location, at).href;
    }
    throw new HubError("network", `${url} redirected more than 10 times.`);
  }

  #fetch(url: string, headers: Record<string, string>): Promise<Response> {
    const sameOrigin = new URL(url).origin === this.#origin;
    return fetch(url, {
      headers: {
        "user-agent": USER_AGENT,
        ...headers,
        ...(sameOrigin && this.#token ? { authorization: `Bearer ${this.#token}` } : {}),
      },
      redirect: "manual",
      ...(this.#signal ? { signal: this.#signal } : {}),
    });
  }

  /** An answer that is not a success, said as what to do about it. */
  async #failure(response: Response, url: string, what: "revision" | "file"): Promise<HubError> {
    const code = response.headers.get("x-error-code");
    const hubSays = response.headers.get("x-error-message") ?? (await bodyMessage(response));
    const says = hubSays ? ` (the Hub says: ${hubSays})` : "";
    const repo = this.#repo;
    const page = `${this.#endpoint}/${repo}`;
    if (code === "GatedRepo")
      return new HubError(
        "access",
        this.#token
          ? `${repo} is gated and the token in HF_TOKEN has no access to it yet${says}: accept its terms at ${page} with the account the token belongs to (some repos wait for the authors' approval), then pull again.`
          : `${repo} is gated${says}: accept its terms at ${page} with your Hugging Face account, then set HF_TOKEN to a token of that account and pull again.`,
        "repo_id",
      );
    if (response.status === 401 && hubSays === "Invalid credentials in Authorization header")
      return new HubError(
        "access",
        `The Hub refused the token in HF_TOKEN as invalid: set HF_TOKEN to a valid token (or unset it for public repos).`,
        "repo_id",
      );
    if (code === "RevisionNotFound")
      return new HubError(
        "not_found",
        `${repo} has no revision ${JSON.stringify(this.#revision)}${says}.`,
        "revision",
      );
    if (code === "EntryNotFound")
      return new HubError("not_found", `${url} does not exist${says}.`, "repo_id");
    if (
      code === "RepoNotFound" ||
      (response.status === 401 && what === "revision") ||
      response.status === 404
    )
      return new HubError(
        "not_found",
        `${repo} was not found on ${this.#endpoint}${says}${this.#token ? "" : "; if it is private, set HF_TOKEN to a token that can read it"}.`,
        "repo_id",
      );
    if (response.status === 401 || response.status === 403)
      return new HubError(
        "access",
        `${url} answered ${response.status}${says}: ${this.#token ? "the token in HF_TOKEN may not read it" : "set HF_TOKEN to a token that may read it"}.`,
        "repo_id",
      );
    return new HubError("network", `${url} answered ${response.status}${says}.`);
  }

  #unreachable(url: string, err: unknown): HubError {
    return new HubError(
      "network",
      `Could not reach the Hub at ${url} (${reasonOf(err)}). Is HF_ENDPOINT right, and is the machine online?`,
    );
  }

  #cutOff(path: string, err: unknown, state: Download | undefined): HubError {
    return new HubError(
      "network",
      `${path}: the download kept failing (${reasonOf(err)}) after ${this.#retries + 1} attempts${state ? `, at byte ${state.bytes} of ${state.size}` : ""}. What arrived is kept: pull again to resume.`,
    );
  }

  async #wait(attempt: number): Promise<void> {
    const ms = this.#retryDelay(attempt);
    if (ms > 0) await new Promise((resolve) => setTimeout(resolve, ms));
    this.#signal?.throwIfAborted();
  }
}

/** Statuses worth asking again. */
function transient(status: number): boolean {
  return status === 408 || status === 429 || status >= 500;
}

/** The expectations of `file`, with what the Hub's headers said where the listing said nothing;
 * a disagreement is an error. */
function reconcile(file: Planned, hub: ResolveHeaders, response: Response, url: string): Planned {
  const out = { ...file };
  const etag = hub.etag?.toLowerCase() ?? null;
  const isSha256 = etag !== null && /^[0-9a-f]{64}$/.test(etag);
  const isBlobId = etag !== null && /^[0-9a-f]{40}$/.test(etag);
  if (
    (out.sha256 && isSha256 && etag !== out.sha256) ||
    (out.blobId && isBlobId && etag !== out.blobId)
  )
    throw new HubError(
      "checksum",
      `${file.path}: the Hub's listing says ${out.sha256 ? `SHA-256 ${out.sha256}` : `blob ${out.blobId}`}, its download ${etag}. Nothing was kept: pull again.`,
    );
  if (!out.sha256 && !out.blobId) {
    if (isSha256) {
      out.sha256 = etag;
      out.lfs = true;
    } else if (isBlobId) out.blobId = etag;
    else throw new HubError("network", `${url} gave no checksum (no X-Linked-Etag or ETag).`);
  }
  if (out.size === undefined) {
    const whole = wholeSize(response);
    out.size = hub.linkedSize ?? whole ?? undefined;
    if (out.size === undefined) throw new HubError("network", `${url} gave no size.`);
  }
  return out;
}

/** The file's whole size from an answer: Content-Range's total on a 206, else Content-Length. */
function wholeSize(response: Response): number | null {
  const range = response.headers.get("content-range");
  if (response.status === 206 && range) return numberOr(range.split("/")[1] ?? null);
  return numberOr(response.headers.get("content-length"));
}

function rangeStartsAt(response: Response, from: number): boolean {
  const range = /^bytes (\d+)-/.exec(response.headers.get("content-range") ?? "");
  return response.status === 206 && range !== null && Number(range[1]) === from;
}

function numberOr(text: string | null): number | null {
  if (text === null || !/^\d+$/.test(text.trim())) return null;
  return Number(text);
}

function unquote(etag: string | null): string | null {
  return etag === null ? null : etag.replace(/^W\//, "").replace(/^"|"$/g, "");
}

/** A file being fetched: where its bytes go, how many are there, and their hashes so far. */
interface Download {
  path: string;
  size: number;
  bytes: number;
  sha256: Hash;
  /** git's blob id: SHA-1 of `blob <size>\0` and the bytes. */
  sha1: Hash;
}

/** The partial file of `file` (whose size and digest are known), with what an earlier run left
 * in it: named by the digest it must have, so only the same file is ever resumed. */
async function resume(staging: string, file: Planned): Promise<Download> {
  const path = join(staging, PARTIAL, file.sha256 ?? `git-${file.blobId}`);
  await mkdir(dirname(path), { recursive: true });
  const size = file.size!;
  const have = (await stat(path).catch(() => undefined))?.size ?? 0;
  return { path, size, ...(await startHashes(path, size, have > size ? 0 : have)) };
}

/** The hashes of the first `have` bytes of `path`, which is cut to that length (emptied for 0). */
async function startHashes(
  path: string,
  size: number,
  have: number,
): Promise<{ sha256: Hash; sha1: Hash; bytes: number }> {
  const sha256 = createHash("sha256");
  const sha1 = createHash("sha1").update(`blob ${size}\0`);
  if (have === 0) {
    await writeFile(path, "");
    return { sha256, sha1, bytes: 0 };
  }
  const handle = await open(path, "r+");
  try {
    await handle.truncate(have);
    const buffer = Buffer.alloc(1 << 20);
    for (let at = 0; at < have; ) {
      const { bytesRead } = await handle.read(buffer, 0, Math.min(buffer.length, have - at), at);
      if (bytesRead === 0) break;
      sha256.update(buffer.subarray(0, bytesRead));
      sha1.update(buffer.subarray(0, bytesRead));
      at += bytesRead;
    }
  } finally {
    await handle.close();
  }
  return { sha256, sha1, bytes: have };
}

/** Whether the listing gave the file's size and a digest to check it by. */
function known(file: Planned): file is Planned & { size: number } {
  return file.size !== undefined && (file.sha256 !== undefined || file.blobId !== undefined);
}

async function hashFile(path: string, size: number): Promise<{ sha256: string; sha1: string }> {
  const sha256 = createHash("sha256");
  const sha1 = createHash("sha1").update(`blob ${size}\0`);
  const handle = await open(path, "r");
  try {
    const buffer = Buffer.alloc(1 << 20);
    for (;;) {
      const { bytesRead } = await handle.read(buffer, 0, buffer.length, null);
      if (bytesRead === 0) break;
      sha256.update(buffer.subarray(0, bytesRead));
      sha1.update(buffer.subarray(0, bytesRead));
    }
  } finally {
    await handle.close();
  }
  return { sha256: sha256.digest("hex"), sha1: sha1.digest("hex") };
}

function matches(file: Planned, digests: { sha256: string; sha1: string }): boolean {
  if (file.sha256) return digests.sha256 === file.sha256;
  return digests.sha1 === file.blobId;
}

function pulled(file: Planned, digests: { sha256: string; sha1: string }): PulledFile {
  return {
    path: file.path,
    size: file.size!,
    sha256: digests.sha256,
    ...(file.blobId ? { git_blob_id: file.blobId } : {}),
    lfs: file.lfs,
  };
}

async function bodyMessage(response: Response): Promise<string | null> {
  const text = await response.text().catch(() => "");
  try {
    const body = JSON.parse(text) as { error?: unknown };
    return typeof body.error === "string" ? body.error : null;
  } catch {
    return text.trim().slice(0, 200) || null;
  }
}

function reasonOf(err: unknown): string {
  let cause: unknown = err;
  while (cause instanceof Error && cause.cause instanceof Error) cause = cause.cause;
  const e = cause as NodeJS.ErrnoException;
  const message = e instanceof Error ? e.message : String(cause);
  return e.code && !message.includes(e.code) ? `${e.code}: ${message}` : message;
}
