import { closeSync, openSync, readFileSync, readSync, statSync } from "node:fs";
import { availableParallelism, homedir } from "node:os";
import { isAbsolute, join, resolve } from "node:path";

/**
 * Every setting Arbor reads from the environment, in one table: its variable, its default, what
 * it does, and how its text is read. The server, the worker processes and the CLI read them
 * through `readConfig`; the README's settings table is generated from this one.
 */

/** Where base-model folders live: `ARBOR_BASE_MODELS_DIR`, else `<data dir>/models`. */
export function baseModelsDir(config: {
  baseModelsDir: string | undefined;
  dataDir: string;
}): string {
  return config.baseModelsDir ?? join(config.dataDir, "models");
}

/** Where adapters served by upstreams are written: `ARBOR_UPSTREAM_LORA_DIR`, else
 * `<data dir>/upstream-lora`. */
export function upstreamLoraDir(config: {
  upstreamLoraDir: string | undefined;
  dataDir: string;
}): string {
  return config.upstreamLoraDir ?? join(config.dataDir, "upstream-lora");
}

/** Adapters an upstream keeps loaded at once when its `maxLoras` is not set. */
export const DEFAULT_UPSTREAM_MAX_LORAS = 8;

/** The first-start admin key, written (mode 0600) in the data directory. */
export function adminKeyPath(dataDir: string): string {
  return join(dataDir, "admin.key");
}

export type Role = "training" | "inference" | "calls";

/** Where checkpoint and dataset files live (`ARBOR_BLOBS`). */
export type BlobBackend = "fs" | "postgres";
export const BLOB_BACKENDS: readonly BlobBackend[] = ["fs", "postgres"];
export const ROLES: readonly Role[] = ["training", "inference", "calls"];

/** Who may read `GET /metrics`: operator keys, anyone, or no one (404). */
export type MetricsAccess = "key" | "public" | "off";
export const METRICS_ACCESS: readonly MetricsAccess[] = ["key", "public", "off"];
/** `ARBOR_ENGINE_WEIGHTS`: how engines keep weights (`WeightDtype` of @arbor/engine). */
export const ENGINE_WEIGHTS = ["auto", "bf16", "f32", "q8"] as const;
export type EngineWeights = (typeof ENGINE_WEIGHTS)[number];

/** An OpenAI-compatible server (vLLM, SGLang, llama.cpp server, another Arbor) that serves a
 * model id of ours. */
export interface UpstreamConfig {
  /** Its base URL, ending in `/v1`. */
  url: string;
  apiKey?: string;
  /** The model name the upstream knows; default: our id. */
  model?: string;
  /** `ARBOR_UPSTREAM_LORA_DIR` as the upstream sees it (its own mount of that directory), for
   * the `lora_path` of the checkpoints it serves; default: the same path. */
  loraDir?: string;
  /** Checkpoint adapters kept loaded on this upstream at once (least recently used unloaded
   * first); default 8. */
  maxLoras?: number;
}

export interface Setting<T> {
  env: string;
  /** Where the table groups it. */
  group: "server" | "store" | "training" | "inference" | "limits" | "cli";
  /** The default as the table shows it. */
  shown: string;
  doc: string;
  /** The value from the variable's text, or the default when it is unset or empty. Throws an
   * Error whose message names what is wrong (the variable's name is added). */
  read(raw: string | undefined): T;
}

function setting<T>(spec: Setting<T>): Setting<T> {
  return spec;
}

const unset = (raw: string | undefined): raw is undefined => raw === undefined || raw.trim() === "";

function integer(raw: string, min: number, max: number): number {
  const value = Number(raw);
  if (!Number.isInteger(value) || value < min || value > max) {
    throw new Error(
      max === Number.MAX_SAFE_INTEGER
        ? `must be an integer of at least ${min}, got ${JSON.stringify(raw)}`
        : `must be an integer from ${min} to ${max}, got ${JSON.stringify(raw)}`,
    );
  }
  return value;
}

/** A positive integer, or `fallback` (which may be undefined: no limit). */
function positive<T extends number | undefined>(fallback: T) {
  return (raw: string | undefined): number | T =>
    unset(raw) ? fallback : integer(raw, 1, Number.MAX_SAFE_INTEGER);
}

/** One of `values` (trimmed), or `fallback` when unset. */
function oneOf<V extends string, T extends V | undefined>(values: readonly V[], fallback: T) {
  return (raw: string | undefined): V | T => {
    if (unset(raw)) return fallback;
    const value = raw.trim();
    if (!values.includes(value as V))
      throw new Error(`must be one of ${values.join(", ")}, got ${JSON.stringify(raw)}`);
    return value as V;
  };
}

function text<T extends string | undefined>(fallback: T) {
  return (raw: string | undefined): string | T => (unset(raw) ? fallback : raw.trim());
}

export const SETTINGS = {
  port: setting({
    env: "ARBOR_PORT",
    group: "server",
    shown: "8080",
    doc: "Port the server listens on (0: any free port).",
    read: (raw) => (unset(raw) ? 8080 : integer(raw, 0, 65535)),
  }),
  host: setting({
    env: "ARBOR_HOST",
    group: "server",
    shown: "127.0.0.1",
    doc: "Address the server listens on.",
    read: text("127.0.0.1"),
  }),
  roles: setting({
    env: "ARBOR_ROLES",
    group: "server",
    shown: "training,inference,calls",
    doc: "The surfaces this process serves; the others' paths answer 404.",
    read: (raw): Role[] => {
      if (unset(raw)) return [...ROLES];
      const roles = raw.split(",").map((r) => r.trim());
      for (const role of roles) {
        if (!ROLES.includes(role as Role))
          throw new Error(
            `has unknown role ${JSON.stringify(role)}; expected some of ${ROLES.join(",")}`,
          );
      }
      return roles as Role[];
    },
  }),
  logLevel: setting({
    env: "ARBOR_LOG_LEVEL",
    group: "server",
    shown: "info",
    doc: "pino log level: trace, debug, info, warn, error, fatal or silent.",
    read: (raw) => {
      const level = unset(raw) ? "info" : raw.trim();
      if (!["trace", "debug", "info", "warn", "error", "fatal", "silent"].includes(level))
        throw new Error(`must be a log level, got ${JSON.stringify(level)}`);
      return level;
    },
  }),
  metrics: setting({
    env: "ARBOR_METRICS",
    group: "server",
    shown: "key",
    doc: "`GET /metrics` (Prometheus text): `key` asks for an operator key (`arbor keys create --operator`; the first-start key is one), `public` serves it to anyone, `off` answers 404.",
    read: oneOf(METRICS_ACCESS, "key"),
  }),
  dataDir: setting({
    env: "ARBOR_DATA_DIR",
    group: "store",
    shown: "~/.arbor",
    doc: "SQLite database, blobs (checkpoints, datasets) when they are kept in files, and the first admin key.",
    read: (raw) => (unset(raw) ? join(homedir(), ".arbor") : raw.trim()),
  }),
  databaseUrl: setting({
    env: "DATABASE_URL",
    group: "store",
    shown: "unset (SQLite)",
    doc: "A `postgres://` URL: keep state in PostgreSQL instead of SQLite.",
    read: (raw) => {
      if (unset(raw)) return undefined;
      if (!/^postgres(ql)?:\/\//.test(raw.trim()))
        throw new Error("must be a postgres:// URL (SQLite is the default when it is unset)");
      return raw.trim();
    },
  }),
  databaseSchema: setting({
    env: "ARBOR_DATABASE_SCHEMA",
    group: "store",
    shown: "the search path's",
    doc: "PostgreSQL only: the schema to use (created when missing).",
    read: (raw) => {
      if (unset(raw)) return undefined;
      if (!/^[a-z_][a-z0-9_]{0,62}$/.test(raw.trim()))
        throw new Error(`must be a lower-case SQL identifier, got ${JSON.stringify(raw)}`);
      return raw.trim();
    },
  }),
  blobs: setting({
    env: "ARBOR_BLOBS",
    group: "store",
    shown: "postgres with DATABASE_URL, else fs",
    doc: "Where checkpoint and dataset files live: `postgres` (tables of the database, shared by every replica and worker) or `fs` (`ARBOR_DATA_DIR/blobs`, a directory every process must share).",
    read: oneOf(BLOB_BACKENDS, undefined),
  }),
  embeddedWorker: setting({
    env: "ARBOR_EMBEDDED_WORKER",
    group: "training",
    shown: "on with the `training` role",
    doc: "`off` when separate worker processes (`apps/worker`) take the jobs. Unset, a process whose `ARBOR_ROLES` leave out `training` runs none.",
    read: (raw) => {
      if (unset(raw) || raw.trim() === "on") return true;
      if (raw.trim() === "off") return false;
      throw new Error(`must be on or off, got ${JSON.stringify(raw)}`);
    },
  }),
  trainingThreads: setting({
    env: "ARBOR_TRAINING_THREADS",
    group: "training",
    shown: "1",
    doc: "Training threads of the embedded worker, or of a worker process (`apps/worker`): jobs of that many models train side by side.",
    read: (raw) => (unset(raw) ? 1 : integer(raw, 1, 64)),
  }),
  workerLeaseMs: setting({
    env: "ARBOR_WORKER_LEASE_MS",
    group: "training",
    shown: "15000",
    doc: "How long a worker's claim on a job lasts unrenewed (renewed every second); a dead worker's job is taken back after it.",
    read: positive(15_000),
  }),
  workerId: setting({
    env: "ARBOR_WORKER_ID",
    group: "training",
    shown: "unset",
    doc: "A stable name for a worker process, so a restarted one takes its jobs back at once.",
    read: (raw) => {
      if (unset(raw)) return undefined;
      if (!/^[A-Za-z0-9._:-]{1,128}$/.test(raw.trim()))
        throw new Error(
          `must be 1-128 of letters, digits, ".", "_", ":" and "-", got ${JSON.stringify(raw)}`,
        );
      return raw.trim();
    },
  }),
  trainingDataMaxBytes: setting({
    env: "ARBOR_TRAINING_DATA_MAX_BYTES",
    group: "training",
    shown: "67108864",
    doc: "Largest `https://` training file fetched, in bytes.",
    read: positive(64 * 1024 * 1024),
  }),
  trainingDataAllowHosts: setting({
    env: "ARBOR_TRAINING_DATA_ALLOW_HOSTS",
    group: "training",
    shown: "none",
    doc: "Comma-separated `host[:port]` (port 443 when none) that `https://` training data may come from even when they resolve to private addresses.",
    read: (raw) =>
      (raw ?? "")
        .split(",")
        .map((h) => h.trim())
        .filter(Boolean),
  }),
  baseModelsDir: setting({
    env: "ARBOR_BASE_MODELS_DIR",
    group: "inference",
    shown: "ARBOR_DATA_DIR/models",
    doc: "Base models from folders: every `<owner>/<name>/` with a Hugging Face `config.json` here is served as `<owner>/<name>` (`arbor models add-base` puts one there).",
    read: text(undefined),
  }),
  hfEndpoint: setting({
    env: "HF_ENDPOINT",
    group: "inference",
    shown: "https://huggingface.co",
    doc: "The Hugging Face Hub (or a mirror that speaks its API) that `arbor models pull` and `POST /v1/preview/base-models/pull` download from, read as the Hub's own tools read it.",
    read: (raw) => {
      if (unset(raw)) return "https://huggingface.co";
      const value = raw.trim().replace(/\/+$/, "");
      if (!/^https?:\/\//.test(value) || !URL.canParse(value))
        throw new Error(`must be an http:// or https:// URL, got ${JSON.stringify(raw)}`);
      return value;
    },
  }),
  hfToken: setting({
    env: "HF_TOKEN",
    group: "inference",
    shown: "unset",
    doc: "A Hugging Face token for gated and private repos, sent as `Authorization: Bearer` to `HF_ENDPOINT` only. Unset, it is read as the Hub's own tools read it: `HUGGING_FACE_HUB_TOKEN`, else the file `hf auth login` writes (`HF_TOKEN_PATH`, default `$HF_HOME/token`, `HF_HOME` defaulting to `~/.cache/huggingface`).",
    read: text(undefined),
  }),
  engineThreads: setting({
    env: "ARBOR_ENGINE_THREADS",
    group: "inference",
    shown: "one per core",
    doc: "Kernel threads of each engine (inference, and each training thread). Node counts cores without container CPU quotas: set it there, and keep engines × threads about the number of cores.",
    read: (raw) => (unset(raw) ? Math.min(availableParallelism(), 64) : integer(raw, 1, 64)),
  }),
  engineWeights: setting({
    env: "ARBOR_ENGINE_WEIGHTS",
    group: "inference",
    shown: "auto",
    doc: "How each engine (inference and training) keeps a base model's weights, packed once in its WebAssembly memory: `bf16` (half the memory, widened to F32 inside the kernels; F32 and F16 files are rounded), `q8` (int8 in blocks of 32 weights with one scale, quantized at load: about 0.56× BF16's memory and the fastest decode; it changes the model's numbers slightly, measured in docs/status.md), `f32`, or `auto`: BF16 when the folder's weight matrices are BF16 (exact: what most models are published in), F32 otherwise. LoRA trains on any of them (full fine-tuning is not offered).",
    read: oneOf(ENGINE_WEIGHTS, "auto"),
  }),
  upstreams: setting({
    env: "ARBOR_UPSTREAMS",
    group: "inference",
    shown: "none",
    doc: 'JSON: model id → `{"url": "http://host/v1", "apiKey"?, "model"?, "loraDir"?, "maxLoras"?}` of an OpenAI-compatible server that serves it. Checkpoints trained on that base are served there too, as LoRA adapters it loads at run time (vLLM\'s `/v1/load_lora_adapter`): `loraDir` is `ARBOR_UPSTREAM_LORA_DIR` as the upstream sees it (default: the same path), `maxLoras` how many it keeps loaded (default 8, least recently used unloaded first).',
    read: (raw): Record<string, UpstreamConfig> => {
      if (unset(raw)) return {};
      const parsed = parseJson(raw);
      if (typeof parsed !== "object" || parsed === null || Array.isArray(parsed))
        throw new Error('must be a JSON object: {"<model id>": {"url": "http://host/v1", ...}}');
      const out: Record<string, UpstreamConfig> = {};
      for (const [id, value] of Object.entries(parsed)) {
        const v = value as Partial<UpstreamConfig> | null;
        if (typeof v?.url !== "string" || !URL.canParse(v.url))
          throw new Error(`[${JSON.stringify(id)}].url must be a URL`);
        if (v.loraDir !== undefined && (typeof v.loraDir !== "string" || !isAbsolute(v.loraDir)))
          throw new Error(`[${JSON.stringify(id)}].loraDir must be an absolute path`);
        if (
          v.maxLoras !== undefined &&
          (!Number.isInteger(v.maxLoras) || v.maxLoras < 1 || v.maxLoras > 1024)
        )
          throw new Error(`[${JSON.stringify(id)}].maxLoras must be an integer from 1 to 1024`);
        out[id] = {
          url: v.url,
          ...(typeof v.apiKey === "string" ? { apiKey: v.apiKey } : {}),
          ...(typeof v.model === "string" ? { model: v.model } : {}),
          ...(v.loraDir !== undefined ? { loraDir: v.loraDir } : {}),
          ...(v.maxLoras !== undefined ? { maxLoras: v.maxLoras } : {}),
        };
      }
      return out;
    },
  }),
  upstreamLoraDir: setting({
    env: "ARBOR_UPSTREAM_LORA_DIR",
    group: "inference",
    shown: "ARBOR_DATA_DIR/upstream-lora",
    doc: "Where checkpoints served by upstreams are written, one PEFT folder each (`adapter_config.json`, `adapter_model.safetensors`), for the upstreams to read: a directory they share with this process (the same host, or a network mount).",
    read: (raw) => {
      if (unset(raw)) return undefined;
      if (!isAbsolute(raw.trim()))
        throw new Error(`must be an absolute path, got ${JSON.stringify(raw)}`);
      return raw.trim();
    },
  }),
  llamaModels: setting({
    env: "ARBOR_LLAMA_MODELS",
    group: "inference",
    shown: "none",
    doc: "JSON: model id → path of a GGUF file that llama.cpp serves (optional `node-llama-cpp`).",
    read: (raw): Map<string, string> => {
      const models = new Map<string, string>();
      if (unset(raw)) return models;
      const parsed = parseJson(raw);
      if (typeof parsed !== "object" || parsed === null || Array.isArray(parsed))
        throw new Error('must be a JSON object {"<model id>": "/path/model.gguf"}');
      const problems: string[] = [];
      for (const [id, value] of Object.entries(parsed)) {
        if (!id.trim() || /\s/.test(id)) {
          problems.push(`model id ${JSON.stringify(id)} must be non-empty, without spaces`);
          continue;
        }
        if (typeof value !== "string" || !value) {
          problems.push(`${id}: the path must be a non-empty string`);
          continue;
        }
        const path = isAbsolute(value) ? value : resolve(value);
        const problem = ggufProblem(path);
        if (problem) problems.push(`${id}: ${path} ${problem}`);
        else models.set(id, path);
      }
      if (problems.length > 0) throw new Error(problems.join("; "));
      return models;
    },
  }),
  keyRequestsPerMinute: setting({
    env: "ARBOR_KEY_RPM",
    group: "limits",
    shown: "unlimited",
    doc: "Chat requests per minute per API key.",
    read: positive(undefined),
  }),
  projectRequestsPerMinute: setting({
    env: "ARBOR_PROJECT_RPM",
    group: "limits",
    shown: "unlimited",
    doc: "Chat requests per minute per project.",
    read: positive(undefined),
  }),
  keyConcurrent: setting({
    env: "ARBOR_KEY_CONCURRENCY",
    group: "limits",
    shown: "unlimited",
    doc: "Concurrent generations per API key.",
    read: positive(undefined),
  }),
  projectConcurrent: setting({
    env: "ARBOR_PROJECT_CONCURRENCY",
    group: "limits",
    shown: "unlimited",
    doc: "Concurrent generations per project.",
    read: positive(undefined),
  }),
  uploadMemoryBytes: setting({
    env: "ARBOR_UPLOAD_MEMORY_BYTES",
    group: "limits",
    shown: "1073741824",
    doc: "Memory the uploads in progress (adapters, and OpenAI fine-tuning files) may hold together, each counted as 4 × its body (as 256 MB when gzipped or of unknown length); past it an upload is answered 503 with `Retry-After` before its body is read. One upload alone is always let in.",
    read: positive(1024 * 1024 * 1024),
  }),
  redisUrl: setting({
    env: "ARBOR_REDIS_URL",
    group: "limits",
    shown: "unset",
    doc: "A `redis://` or `rediss://` URL: keep the rate limits' state in Redis. Without it they are kept in PostgreSQL with `DATABASE_URL`, else in the process.",
    read: (raw) => {
      if (unset(raw)) return undefined;
      const value = raw.trim();
      if (!/^rediss?:\/\//.test(value) || !URL.canParse(value))
        throw new Error("must be a redis:// or rediss:// URL");
      return value;
    },
  }),
  baseUrl: setting({
    env: "ARBOR_BASE_URL",
    group: "cli",
    shown: "http://ARBOR_HOST:ARBOR_PORT",
    doc: "The server the CLI's remote commands and the examples in `examples/` call.",
    read: (raw) => {
      if (unset(raw)) return undefined;
      if (!URL.canParse(raw.trim())) throw new Error(`must be a URL, got ${JSON.stringify(raw)}`);
      return raw.trim().replace(/\/+$/, "");
    },
  }),
  apiKey: setting({
    env: "ARBOR_API_KEY",
    group: "cli",
    shown: "ARBOR_DATA_DIR/admin.key",
    doc: "The key the CLI sends (default: the first-start admin key file).",
    read: text(undefined),
  }),
  project: setting({
    env: "ARBOR_PROJECT",
    group: "cli",
    shown: "unset",
    doc: "`<entity>/<project>` the CLI's chats are recorded under.",
    read: text(undefined),
  }),
};

export type Settings = typeof SETTINGS;
export type Config = { [K in keyof Settings]: ReturnType<Settings[K]["read"]> };

/**
 * Reads every setting from `env` at once. Throws one Error listing every problem, each naming
 * its variable, so a bad environment fails at start with all its mistakes.
 */
export function readConfig(env: NodeJS.ProcessEnv = process.env): Config {
  const config: Record<string, unknown> = {};
  const problems: string[] = [];
  for (const [key, spec] of Object.entries(SETTINGS) as [keyof Settings, Setting<unknown>][]) {
    try {
      config[key] = spec.read(env[spec.env]);
    } catch (err) {
      problems.push(`${spec.env} ${err instanceof Error ? err.message : String(err)}`);
    }
  }
  if (config.blobs === "postgres" && unset(env[SETTINGS.databaseUrl.env])) {
    problems.push("ARBOR_BLOBS=postgres needs DATABASE_URL (SQLite keeps blobs in files)");
  }
  if (problems.length > 0) throw new Error(`Bad settings: ${problems.join("; ")}`);
  const read = config as Config;
  read.hfToken ??= hubTokenFallback(env);
  // Unset, the embedded worker follows the roles: an inference or calls replica trains nothing.
  if (unset(env[SETTINGS.embeddedWorker.env]) && !read.roles.includes("training"))
    read.embeddedWorker = false;
  return read;
}

/**
 * The Hub token when `HF_TOKEN` is unset, where huggingface_hub looks next: the older
 * `HUGGING_FACE_HUB_TOKEN`, then the token file (`HF_TOKEN_PATH`, else `HF_HOME/token`, `HF_HOME`
 * defaulting to `$XDG_CACHE_HOME/huggingface` or `$HOME/.cache/huggingface`). Only the variables
 * in `env` are read, so an environment without `HOME` finds no file.
 */
function hubTokenFallback(env: NodeJS.ProcessEnv): string | undefined {
  const value = (name: string) => (unset(env[name]) ? undefined : env[name]!.trim());
  const legacy = value("HUGGING_FACE_HUB_TOKEN");
  if (legacy) return legacy;
  const cache = value("XDG_CACHE_HOME") ?? (value("HOME") && join(value("HOME")!, ".cache"));
  const hfHome = value("HF_HOME") ?? (cache && join(cache, "huggingface"));
  const file = value("HF_TOKEN_PATH") ?? (hfHome && join(hfHome, "token"));
  if (!file) return undefined;
  try {
    return readFileSync(file, "utf8").trim() || undefined;
  } catch {
    return undefined;
  }
}

/** The settings as the README's Markdown table. */
export function settingsTable(): string {
  const rows = (Object.values(SETTINGS) as Setting<unknown>[])
    .map((s) => `| \`${s.env}\` | ${s.group} | ${s.shown} | ${s.doc} |`)
    .join("\n");
  return `| variable | for | default | what it does |\n|---|---|---|---|\n${rows}\n`;
}

function parseJson(raw: string): unknown {
  try {
    return JSON.parse(raw);
  } catch (err) {
    throw new Error(`is not valid JSON: ${err instanceof Error ? err.message : String(err)}`);
  }
}

function ggufProblem(path: string): string | null {
  try {
    if (!statSync(path).isFile()) return "is not a file";
    const fd = openSync(path, "r");
    try {
      const magic = Buffer.alloc(4);
      const read = readSync(fd, magic, 0, 4, 0);
      if (read < 4 || magic.toString("latin1") !== "GGUF") return "is not a GGUF file";
    } finally {
      closeSync(fd);
    }
    return null;
  } catch (err) {
    const code = (err as { code?: string }).code;
    return code === "ENOENT" ? "does not exist" : `cannot be read (${code ?? String(err)})`;
  }
}
