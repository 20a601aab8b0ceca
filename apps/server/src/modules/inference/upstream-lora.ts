import { randomBytes } from "node:crypto";
import { createWriteStream } from "node:fs";
import { mkdir, open, readdir, rename, rm, stat } from "node:fs/promises";
import { join, posix } from "node:path";
import { pipeline } from "node:stream/promises";
import { DEFAULT_UPSTREAM_MAX_LORAS, type UpstreamConfig } from "@arbor/config";
import type { BlobStore } from "@arbor/store";
import { ADAPTER_FILES, CHECKPOINTS_PREFIX } from "@arbor/training";
import type { Logger } from "pino";
import { CheckpointGoneError } from "./engines.ts";
import { unavailable, upstreamAuth, upstreamBase, upstreamMessage } from "./upstream.ts";

/** How old a cut-off adapter folder must be before a sweep removes it. */
const PARTIAL_AGE_MS = 60 * 60_000;

/** How long one call to an upstream's LoRA endpoints may take before it counts as failed (a
 * load reads the files and moves the weights; a hung one must not hold its adapter forever). */
const LORA_CALL_MS = 120_000;

/**
 * The name a checkpoint's adapter is loaded under on every upstream, and its folder's name in
 * the shared directory. It comes from the key of the checkpoint's files
 * (`checkpoints/<model id>/<step>-<uuid>/`), which names one set of files that never changes:
 * a name loaded anywhere always means the same weights, and a model deleted and created again
 * under the same name never meets its predecessor's adapters.
 */
export function loraNameOf(blobKey: string): string {
  const key = blobKey.replace(/\/+$/, "");
  const local = key.startsWith(CHECKPOINTS_PREFIX) ? key.slice(CHECKPOINTS_PREFIX.length) : key;
  return `arbor.${local.replaceAll("/", ".")}`;
}

/** An adapter ready on an upstream for one request. Released once the upstream has taken the
 * request (its response headers are in); until then it is never unloaded for another. */
export interface AdapterLease {
  /** The `lora_name` to ask for as the request's `model`. */
  readonly name: string;
  release(): void;
}

interface Loaded {
  name: string;
  /** Its registration: settles once, shared by every request that waits for it. */
  loading: Promise<void>;
  settled: boolean;
  /** Requests that hold it until the upstream has taken them. */
  leases: number;
}

/** One upstream server (by URL) and the adapters this process has loaded on it, least
 * recently used first. */
interface Upstream {
  base: string;
  auth: Record<string, string>;
  /** The shared directory as the upstream sees it. */
  loraDir: string;
  max: number;
  loaded: Map<string, Loaded>;
  /** Requests waiting for a place: every adapter loaded is held by a request. */
  waiting: Set<() => void>;
}

export interface UpstreamAdaptersOptions {
  /** `ARBOR_UPSTREAMS`. */
  upstreams: Record<string, UpstreamConfig>;
  /** `ARBOR_UPSTREAM_LORA_DIR`: where this process writes the adapters' folders. */
  dir: string;
  blobs: BlobStore;
  logger: Logger;
}

/**
 * Trained checkpoints served by upstream engines (ADR 40), through vLLM's runtime LoRA loading:
 * a checkpoint's PEFT files are written once into a directory the upstream can read, registered
 * with `POST /v1/load_lora_adapter` before the first request that needs them (once however many
 * requests ask at the same time), and at most `maxLoras` stay loaded per upstream: the least
 * recently used one not held by a request is unloaded (`POST /v1/unload_lora_adapter`) before
 * another is loaded. Deleting a checkpoint unloads it wherever it is loaded and removes its folder.
 *
 * What is loaded is this process's view: another replica's loads and unloads, or an upstream
 * that restarted, show up as an upstream that does not know a name, and the request registers
 * it again (`forgotten`).
 */
export class UpstreamAdapters {
  readonly #dir: string;
  readonly #blobs: BlobStore;
  readonly #logger: Logger;
  /** By URL: model ids served by one server share its adapters and its limit. */
  readonly #upstreams = new Map<string, Upstream>();
  /** By model id of ARBOR_UPSTREAMS. */
  readonly #byModel = new Map<string, Upstream>();
  /** Folders being written, by name: concurrent first requests write them once. */
  readonly #writing = new Map<string, Promise<void>>();

  constructor(options: UpstreamAdaptersOptions) {
    this.#dir = options.dir;
    this.#blobs = options.blobs;
    this.#logger = options.logger;
    for (const [id, config] of Object.entries(options.upstreams)) {
      this.#byModel.set(id, this.#upstream(config));
    }
  }

  #upstream(config: UpstreamConfig): Upstream {
    const base = upstreamBase(config);
    const max = config.maxLoras ?? DEFAULT_UPSTREAM_MAX_LORAS;
    const known = this.#upstreams.get(base);
    if (known) {
      // Two model ids on one server: the smaller limit holds for both.
      known.max = Math.min(known.max, max);
      return known;
    }
    const upstream: Upstream = {
      base,
      auth: upstreamAuth(config),
      loraDir: config.loraDir ?? this.#dir,
      max,
      loaded: new Map(),
      waiting: new Set(),
    };
    this.#upstreams.set(base, upstream);
    return upstream;
  }

  /**
   * Writes the checkpoint's PEFT files (`adapter_config.json`, `adapter_model.safetensors`) into
   * `<dir>/<lora name>/` unless they are there: into a temporary folder first, renamed into
   * place, so an upstream (or another replica) sees the whole folder or none. Whatever the blob
   * store is, the upstream reads plain files. A checkpoint whose files are gone throws
   * CheckpointGoneError.
   */
  materialise(blobKey: string): Promise<void> {
    const name = loraNameOf(blobKey);
    let writing = this.#writing.get(name);
    if (!writing) {
      writing = this.#write(blobKey, name).finally(() => this.#writing.delete(name));
      this.#writing.set(name, writing);
    }
    return writing;
  }

  /**
   * Removes the temporary folders of writes a crash cut off (`.partial-*`), once an hour old: a
   * write in progress, here or on a replica sharing the directory, is younger. Returns their
   * names.
   */
  async sweepPartial(): Promise<string[]> {
    const now = Date.now();
    const entries = await readdir(this.#dir).catch(() => [] as string[]);
    const removed: string[] = [];
    for (const entry of entries.filter((e) => e.startsWith(".partial-"))) {
      const path = join(this.#dir, entry);
      const info = await stat(path).catch(() => undefined);
      if (!info || now - info.mtimeMs <= PARTIAL_AGE_MS) continue;
      await rm(path, { recursive: true, force: true });
      removed.push(entry);
    }
    return removed;
  }

  async #write(blobKey: string, name: string): Promise<void> {
    const target = join(this.#dir, name);
    if (await complete(target)) return;
    await mkdir(this.#dir, { recursive: true });
    const temp = join(
      this.#dir,
      `.partial-${name}-${process.pid}-${randomBytes(6).toString("hex")}`,
    );
    await mkdir(temp);
    try {
      for (const file of ADAPTER_FILES) {
        const source = await this.#blobs.stream(`${blobKey}${file}`);
        if (!source) throw new CheckpointGoneError(name);
        const path = join(temp, file);
        await pipeline(source, createWriteStream(path, { flags: "wx", mode: 0o644 }));
        const handle = await open(path, "r");
        await handle.sync().finally(() => handle.close());
      }
      // An incomplete folder (removed by hand in part) is replaced; a complete one written by
      // another process meanwhile is kept (the rename onto it fails: it is not empty).
      if (!(await complete(target))) await rm(target, { recursive: true, force: true });
      await rename(temp, target).catch(async (err: unknown) => {
        if (!(await complete(target))) throw err;
      });
    } finally {
      await rm(temp, { recursive: true, force: true });
    }
  }

  /**
   * The checkpoint's adapter, loaded on `config`'s upstream and held for one request. The first
   * request registers it; those arriving meanwhile wait for that registration. When the
   * upstream has `maxLoras` loaded, the least recently used one no request holds is unloaded
   * first; when every one is held, this waits for one to be released.
   */
  async acquire(
    config: UpstreamConfig,
    blobKey: string,
    signal: AbortSignal,
  ): Promise<AdapterLease> {
    const upstream = this.#upstream(config);
    const name = loraNameOf(blobKey);
    for (;;) {
      signal.throwIfAborted();
      let entry = upstream.loaded.get(name);
      if (entry) {
        // Most recently used: to the end of the order.
        upstream.loaded.delete(name);
        upstream.loaded.set(name, entry);
      } else {
        let victim: Loaded | undefined;
        if (upstream.loaded.size >= upstream.max) {
          victim = [...upstream.loaded.values()].find((e) => e.settled && e.leases === 0);
          if (!victim) {
            await this.#place(upstream, signal);
            continue;
          }
          upstream.loaded.delete(victim.name);
        }
        entry = this.#register(upstream, blobKey, name, victim?.name);
      }
      const lease = this.#lease(upstream, entry);
      try {
        await abortable(entry.loading, signal);
      } catch (err) {
        lease.release();
        throw err;
      }
      return lease;
    }
  }

  /** Starts registering `name` (after unloading `evicted`, so the upstream never holds more
   * than its limit from us); the entry leaves the order if it fails. */
  #register(upstream: Upstream, blobKey: string, name: string, evicted?: string): Loaded {
    const entry: Loaded = { name, loading: Promise.resolve(), settled: false, leases: 0 };
    entry.loading = (async () => {
      if (evicted) await this.#unload(upstream, evicted);
      await this.materialise(blobKey);
      await this.#load(upstream, name);
    })();
    entry.loading.then(
      () => {
        entry.settled = true;
        // A settled entry no request holds can now be evicted: a waiter may have its place.
        this.#wake(upstream);
      },
      () => {
        entry.settled = true;
        if (upstream.loaded.get(name) === entry) upstream.loaded.delete(name);
        this.#wake(upstream);
      },
    );
    upstream.loaded.set(name, entry);
    return entry;
  }

  #lease(upstream: Upstream, entry: Loaded): AdapterLease & { entry: Loaded } {
    entry.leases++;
    let released = false;
    return {
      name: entry.name,
      entry,
      release: () => {
        if (released) return;
        released = true;
        entry.leases--;
        if (entry.leases === 0) this.#wake(upstream);
      },
    };
  }

  /** Waits until an adapter of `upstream` is released or leaves. */
  #place(upstream: Upstream, signal: AbortSignal): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      const done = () => {
        upstream.waiting.delete(done);
        signal.removeEventListener("abort", aborted);
        resolve();
      };
      const aborted = () => {
        upstream.waiting.delete(done);
        reject(signal.reason);
      };
      upstream.waiting.add(done);
      signal.addEventListener("abort", aborted, { once: true });
    });
  }

  #wake(upstream: Upstream): void {
    for (const waiter of [...upstream.waiting]) waiter();
  }

  /**
   * The upstream answered that it does not know the leased adapter: it restarted, or another
   * replica unloaded it. It is taken out of the order, so the next `acquire` registers it again
   * (once, for every request that found it gone with this same registration).
   */
  forgotten(lease: AdapterLease): void {
    const { entry } = lease as AdapterLease & { entry?: Loaded };
    if (!entry) return;
    for (const upstream of this.#upstreams.values()) {
      if (upstream.loaded.get(entry.name) === entry) {
        upstream.loaded.delete(entry.name);
        this.#logger.info(
          { upstream: upstream.base, lora: entry.name },
          "the upstream no longer knows the adapter; registering it again",
        );
      }
    }
  }

  /**
   * Checkpoints of a model on `baseModel` were deleted (their rows already gone): each upstream
   * serving that base unloads those of them it has loaded, by this process or another (its
   * `GET /v1/models` lists them; when it cannot, each is unloaded anyway), and their folders
   * are removed. Never throws: an upstream that cannot be reached keeps them until it restarts.
   */
  async deleted(baseModel: string, blobKeys: readonly string[]): Promise<void> {
    const names = blobKeys.map(loraNameOf);
    if (names.length === 0) return;
    const upstream = this.#byModel.get(baseModel);
    if (upstream) {
      for (const name of names) upstream.loaded.delete(name);
      this.#wake(upstream);
      const listed = await this.#listed(upstream);
      // Side by side: a model's many checkpoints never wait on each other's calls.
      await Promise.all(
        names
          .filter((name) => !listed || listed.has(name))
          .map((name) => this.#unload(upstream, name)),
      );
    }
    await Promise.all(
      names.map(async (name) => {
        await this.#writing.get(name)?.catch(() => {});
        await rm(join(this.#dir, name), { recursive: true, force: true }).catch((err: unknown) =>
          this.#logger.warn({ err, lora: name }, "could not remove an adapter's folder"),
        );
      }),
    );
  }

  /** `POST /v1/load_lora_adapter`. vLLM answers 400 "has already been loaded" for a name it
   * has (loaded by another replica, or before this process restarted): the same files, so
   * that is success. Anything else that is not a 2xx is our 503, with the upstream's reason. */
  async #load(upstream: Upstream, name: string): Promise<void> {
    const lora_path = posix.join(upstream.loraDir, name);
    const response = await this.#call(upstream, "/load_lora_adapter", {
      lora_name: name,
      lora_path,
    });
    if (response.ok) {
      await response.body?.cancel();
      this.#logger.info({ upstream: upstream.base, lora: name, lora_path }, "adapter loaded");
      return;
    }
    const message = await upstreamMessage(response);
    if (response.status === 400 && /already been loaded/i.test(message)) return;
    throw unavailable(
      `the upstream for this model did not load the checkpoint's adapter from ${lora_path} ` +
        `(POST /v1/load_lora_adapter answered ${response.status}: ${message || "no reason"}); ` +
        "vLLM loads adapters at run time with --enable-lora and " +
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, from ARBOR_UPSTREAM_LORA_DIR as it sees it " +
        "(the upstream's loraDir)",
    );
  }

  /** `POST /v1/unload_lora_adapter`; a name it does not have (404) is already gone. Failures
   * are logged, never thrown: the upstream keeps the adapter until it restarts. */
  async #unload(upstream: Upstream, name: string): Promise<void> {
    try {
      const response = await this.#call(upstream, "/unload_lora_adapter", { lora_name: name });
      if (response.ok || response.status === 404) {
        await response.body?.cancel();
        this.#logger.info({ upstream: upstream.base, lora: name }, "adapter unloaded");
        return;
      }
      const message = await upstreamMessage(response);
      this.#logger.warn(
        { upstream: upstream.base, lora: name, status: response.status, message },
        "the upstream did not unload an adapter",
      );
    } catch (err) {
      this.#logger.warn(
        { err, upstream: upstream.base, lora: name },
        "could not unload an adapter",
      );
    }
  }

  /** The model ids the upstream lists (vLLM lists loaded adapters by name), or undefined. */
  async #listed(upstream: Upstream): Promise<Set<string> | undefined> {
    try {
      const response = await fetch(`${upstream.base}/models`, {
        headers: upstream.auth,
        signal: AbortSignal.timeout(LORA_CALL_MS),
      });
      if (!response.ok) {
        await response.body?.cancel();
        return undefined;
      }
      const { data } = (await response.json()) as { data?: { id?: unknown }[] };
      if (!Array.isArray(data)) return undefined;
      return new Set(data.flatMap((m) => (typeof m?.id === "string" ? [m.id] : [])));
    } catch {
      return undefined;
    }
  }

  async #call(upstream: Upstream, path: string, body: Record<string, unknown>): Promise<Response> {
    try {
      return await fetch(`${upstream.base}${path}`, {
        method: "POST",
        headers: { "content-type": "application/json", ...upstream.auth },
        body: JSON.stringify(body),
        signal: AbortSignal.timeout(LORA_CALL_MS),
      });
    } catch (err) {
      throw unavailable(
        `the upstream for this model is unreachable (POST ${path}: ${err instanceof Error ? err.message : String(err)})`,
      );
    }
  }
}

/** Both PEFT files are in `dir`. */
async function complete(dir: string): Promise<boolean> {
  for (const file of ADAPTER_FILES) {
    const info = await stat(join(dir, file)).catch(() => undefined);
    if (!info?.isFile()) return false;
  }
  return true;
}

/** `promise`, or the signal's reason as soon as it aborts (the promise goes on for others). */
function abortable<T>(promise: Promise<T>, signal: AbortSignal): Promise<T> {
  if (signal.aborted) return Promise.reject(signal.reason);
  return new Promise<T>((resolve, reject) => {
    const aborted = () => reject(signal.reason);
    signal.addEventListener("abort", aborted, { once: true });
    promise.then(
      (value) => {
        signal.removeEventListener("abort", aborted);
        resolve(value);
      },
      (err: unknown) => {
        signal.removeEventListener("abort", aborted);
        reject(err);
      },
    );
  });
}
