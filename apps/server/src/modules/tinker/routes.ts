import { randomUUID } from "node:crypto";
import { pipeline } from "node:stream/promises";
import type { BaseModelFolder } from "@arbor/engine/model";
import {
  type Checkpoint,
  ConflictError,
  DomainError,
  InvalidInputError,
  type Json,
  NotFoundError,
  type OperationKind,
  quote,
  type Store,
  type TrainingOperation,
  type TrainingRun,
  type TrainingState,
} from "@arbor/store";
import { checkpointAdapterTar } from "@arbor/training";
import express, { type NextFunction, type Request, type Response, type Router } from "express";
import type { Logger } from "pino";
import type { Authenticate } from "../../http/auth.ts";
import { toApiError } from "../../http/errors.ts";
import type { Principal, ProjectRef } from "../access.ts";
import type { EngineHost } from "../inference/engines.ts";
import { runLedger } from "../training-runs/routes.ts";
import { findRun, fingerprint, keptResult } from "../training-runs/service.ts";
import {
  decodeForwardBackward,
  encodeForwardBackwardOutput,
  encodeSampleResponse,
  type ForwardBackwardObject,
  int32s,
  type SampledSequence,
  tensorValues,
} from "./proto.ts";

/**
 * Tinker's API (ADR 71, docs/tinker.md) over the native training runs (ADR 57, 58): a training
 * client is a run, each sequenced request one command of its ledger, run by the same workers;
 * a future is the operation it admitted. Mounted under `/tinker/api/v1`, outside the OpenAPI
 * document: the protocol is specified by `spec/tinker/tinker_public.proto` and the docs page.
 */

/** Where the SDK's base URL points (`TINKER_BASE_URL=http://host:port/tinker`). */
export const TINKER_PREFIX = "/tinker";
/** The project a Tinker run publishes its sampler weights into, as a model per run. */
export const TINKER_PROJECT = "tinker";
/** How long `retrieve_future` waits for an operation before answering `try_again`: well under
 * the SDK's 45 s read timeout. */
export const LONG_POLL_MS = 20_000;
const POLL_EVERY_MS = 100;

export interface TinkerDeps {
  store: Store;
  engines: EngineHost;
  authenticate: Authenticate;
  logger: Logger;
  onAdmitted?: () => void;
}

type Body = Record<string, unknown>;

/** The key of `X-API-Key`: Arbor's own key, or `tml-` before it (the SDK insists on the prefix). */
export function keyOf(header: string | undefined): string | null {
  if (!header) return null;
  const key = header.trim();
  return key.startsWith("tml-") ? key.slice(4) : key;
}

/** A failure in the shape the SDK reads (`{detail}`, FastAPI's, as Tinker's service answers). */
class TinkerError extends Error {
  readonly status: number;
  constructor(status: number, message: string) {
    super(message);
    this.status = status;
  }
}

const invalid = (message: string, param?: string) =>
  new InvalidInputError(message, { code: "invalid_value", ...(param ? { param } : {}) });

/** The LoRA targets of Tinker's `lora_config` switches, by PEFT's names (ADR 51's head). */
export function targetsOf(config: {
  train_attn?: unknown;
  train_mlp?: unknown;
  train_unembed?: unknown;
}): string[] {
  const targets: string[] = [];
  if (config.train_attn !== false) targets.push("q_proj", "k_proj", "v_proj", "o_proj");
  if (config.train_mlp !== false) targets.push("gate_proj", "up_proj", "down_proj");
  if (config.train_unembed !== false) targets.push("lm_head");
  return targets.sort();
}

/**
 * Hub ids the cookbook knows, mapped to a served base of the same tokenizer family (ADR 71):
 * `Qwen/Qwen3-*` to a served `Qwen/Qwen3-*` (all sizes share one tokenizer), Llama 3's to a
 * served Llama 3, whatever the case of the served id (`qwen/Qwen3-0.6B`, as the README adds one).
 * The shipped `arbor/tiny-chat` has a tokenizer of its own: no alias reaches it.
 */
const FAMILIES: readonly RegExp[] = [/^Qwen\/Qwen3-/i, /^meta-llama\/(Meta-)?Llama-3/i];

/** The served base a `base_model` names: itself when served, else the smallest served base
 * of its tokenizer family; undefined when none. */
export function servedBase(
  name: string,
  bases: readonly BaseModelFolder[],
): BaseModelFolder | undefined {
  const exact = bases.find((b) => b.id === name);
  if (exact) return exact;
  const family = FAMILIES.find((f) => f.test(name));
  if (!family) return undefined;
  return bases.filter((b) => family.test(b.id)).sort((a, b) => a.parameters - b.parameters)[0];
}

/** A future's id: the operation it admitted (`op.<run>.<operation>`, `.e` for an ephemeral
 * sampler save), or an answer known at once (`model.<run>`). */
type FutureId =
  | { kind: "op"; runId: string; opId: string; ephemeral: boolean }
  | { kind: "model"; runId: string }
  | { kind: "sample"; id: string };

export function parseFutureId(id: string): FutureId | null {
  const parts = id.split(".");
  if (parts[0] === "op" && (parts.length === 3 || (parts.length === 4 && parts[3] === "e")))
    return { kind: "op", runId: parts[1]!, opId: parts[2]!, ephemeral: parts.length === 4 };
  if (parts[0] === "model" && parts.length === 2) return { kind: "model", runId: parts[1]! };
  if (parts[0] === "sample" && parts.length === 2) return { kind: "sample", id: id };
  return null;
}

/** `tinker://<run>/<weights|sampler_weights>/<name>` read back. */
export function parseTinkerPath(
  path: string,
): { runId: string; kind: "weights" | "sampler_weights"; name: string } | null {
  const m = /^tinker:\/\/([^/]+)\/(weights|sampler_weights)\/([^/]+)$/.exec(path);
  return m ? { runId: m[1]!, kind: m[2] as "weights" | "sampler_weights", name: m[3]! } : null;
}

const ENDED = new Set(["succeeded", "failed", "cancelled"]);
/** How long an archive's download URL works. */
const ARCHIVE_TTL_MS = 3600 * 1000;

/** A checkpoint as Tinker lists it, with where its files are. */
interface TinkerCheckpoint {
  checkpoint_id: string;
  checkpoint_type: "training" | "sampler";
  time: string;
  tinker_path: string;
  public: boolean;
  expires_at: string | null;
  files:
    | { kind: "state"; state: TrainingState }
    | { kind: "checkpoint"; checkpoint: Checkpoint; modelId: string };
}

/** What a sampling session samples: a served base, or a learner version a run published
 * (`sampler.<run>.<step>`: checkpoint step `<step>` of the run's model, ADR 71). */
type Sampler =
  | { kind: "base"; baseId: string }
  | { kind: "checkpoint"; runId: string; step: number };

export function samplerId(sampler: Sampler): string {
  return sampler.kind === "base"
    ? `base.${Buffer.from(sampler.baseId).toString("base64url")}`
    : `sampler.${sampler.runId}.${sampler.step}`;
}

export function parseSamplerId(id: string): Sampler | null {
  const parts = id.split(".");
  if (parts[0] === "base" && parts.length === 2)
    return { kind: "base", baseId: Buffer.from(parts[1]!, "base64url").toString("utf8") };
  if (parts[0] === "sampler" && parts.length === 3 && /^\d+$/.test(parts[2]!))
    return { kind: "checkpoint", runId: parts[1]!, step: Number(parts[2]) };
  return null;
}

/** A sample future: held in this process until read (samples are not in the ledger). */
interface SampleFuture {
  /** The user whose key asked for it: only theirs read it. */
  userId: string;
  done: Promise<{ bytes: Uint8Array } | { error: string; category: string }>;
}
/** How long an unread sample result is kept. */
const SAMPLE_TTL_MS = 30 * 60 * 1000;

export function tinkerRouter(deps: TinkerDeps): Router {
  const { store, engines } = deps;
  const ledger = runLedger({
    store,
    engines,
    ...(deps.onAdmitted ? { onAdmitted: deps.onAdmitted } : {}),
  });
  /** Archive downloads handed out: a token names one checkpoint's files for an hour. */
  const archives = new Map<
    string,
    {
      checkpoint: Pick<Checkpoint, "blob_key" | "step" | "created_at">;
      label: string;
      expires: number;
    }
  >();
  const router = express.Router();

  // An archive's download: its token is the capability (the cookbook fetches it bare).
  router.get("/archives/:token", (req: Request, res: Response, next: NextFunction) => {
    const archive = archives.get(String(req.params.token));
    if (!archive || archive.expires <= Date.now())
      return next(new TinkerError(404, "Unknown or expired archive."));
    checkpointAdapterTar(store.blobs, archive.checkpoint, archive.label, { tinker: true })
      .then(async (tar) => {
        res.status(200);
        res.setHeader("Content-Type", "application/x-tar");
        res.setHeader("Content-Length", String(tar.bytes));
        const file = archive.label.replace(/[^A-Za-z0-9._-]/g, "-");
        res.setHeader("Content-Disposition", `attachment; filename="${file}-peft.tar"`);
        await pipeline(await tar.open(), res);
      })
      .catch(next);
  });

  // X-API-Key on every route but the health check.
  router.use((req: Request, res: Response, next: NextFunction) => {
    if (req.path === "/api/v1/healthz") return next();
    const key = keyOf(req.header("x-api-key"));
    if (!key) return next(new TinkerError(401, "Missing API key: send X-API-Key: tml-<key>."));
    deps
      .authenticate(key)
      .then((principal) => {
        if (!principal) return next(new TinkerError(401, "Invalid API key."));
        res.locals.principal = principal;
        next();
      })
      .catch(next);
  });
  // Bodies are read only once the key is known.
  router.use(express.json({ limit: "64mb" }));
  router.use(express.raw({ type: "application/x-protobuf", limit: "256mb" }));

  const handle =
    (fn: (req: Request, res: Response, principal: Principal) => Promise<unknown>) =>
    (req: Request, res: Response, next: NextFunction) => {
      fn(req, res, res.locals.principal as Principal)
        .then((out) => {
          if (out === undefined || res.headersSent) return;
          if (out instanceof Uint8Array)
            res.status(200).type("application/x-protobuf").send(Buffer.from(out));
          else res.status(200).json(out);
        })
        .catch(next);
    };
  const body = (req: Request): Body => {
    if (req.body === null || typeof req.body !== "object" || Buffer.isBuffer(req.body))
      throw invalid("The body must be a JSON object.");
    return req.body as Body;
  };
  /** The project a run's commands act in: its entity's `tinker`, where its model is. */
  const projectOf = (run: TrainingRun): ProjectRef => ({
    entity: run.entity,
    project: TINKER_PROJECT,
    id: `${run.entity}/${TINKER_PROJECT}`,
  });
  const modelName = (run: TrainingRun) => `run-${run.id}`;
  const runOf = (principal: Principal, modelId: unknown) => {
    if (typeof modelId !== "string" || modelId === "") throw invalid("model_id is required.");
    return findRun(store, principal, modelId);
  };

  /**
   * One sequenced request of a training client as a command of its run's ledger: a retry of a
   * request already admitted (the same `seq_id`) answers its operation; else the command takes
   * the run's next sequence id (the SDK sends a client's requests one at a time, in order).
   */
  const submit = async (
    principal: Principal,
    run: TrainingRun,
    kind: OperationKind,
    seqId: unknown,
    command: Record<string, Json>,
    ephemeral = false,
  ) => {
    const seq = Number(seqId);
    const requestId = `${
      Number.isSafeInteger(seq) && seq > 0 ? `tinker-seq-${seq}` : `tinker-${randomUUID()}`
    }${ephemeral ? "-ephemeral" : ""}`;
    const suffix = ephemeral ? ".e" : "";
    const existing = await store.trainingRuns.getOperationByRequest(run.id, requestId);
    if (existing) {
      // The same request again (the SDK's retries): its operation. Other content: refused.
      const body = { request_id: requestId, sequence_id: existing.sequence_id, ...command };
      if (fingerprint({ kind, body }) !== existing.fingerprint)
        throw new ConflictError(`seq_id ${seq} was sent before with another request.`, {
          code: "request_id_reused",
          shouldRetry: false,
        });
      return { request_id: `op.${run.id}.${existing.id}${suffix}`, model_id: run.id };
    }
    const fresh = await findRun(store, principal, run.id);
    const op = await ledger.submit(
      kind,
      run.id,
      { request_id: requestId, sequence_id: fresh.next_sequence_id, ...command },
      principal,
      projectOf(run),
    );
    return { request_id: `op.${run.id}.${op.operation_id}${suffix}`, model_id: run.id };
  };

  const api = express.Router();
  router.use("/api/v1", api);

  api.get("/healthz", (_req, res) => {
    res.json({ status: "ok" });
  });
  api.post(
    "/client/config",
    handle(async () => ({
      pjwt_auth_enabled: false,
      use_pyqwest_transport: false,
      parallel_fwdbwd_chunks: false,
      proto_compress_fwdbwd: false,
      create_model_via_load_weights: false,
      sample_use_retrieve_futures: false,
    })),
  );
  api.post(
    "/client/dynamic_config",
    handle(async () => ({ refresh_interval_sec: 300, sample_cancel_enabled: false })),
  );
  api.post(
    "/create_session",
    handle(async (req) => {
      const version = String(body(req).sdk_version ?? "");
      const tested = /^0\.25\./.test(version);
      return {
        session_id: `session-${randomUUID()}`,
        type: "create_session",
        ...(tested || version === ""
          ? {}
          : {
              info_message: `Arbor's Tinker API is tested with SDK 0.25; this is ${version} (see docs/tinker.md).`,
            }),
      };
    }),
  );
  api.post(
    "/session_heartbeat",
    handle(async () => ({ type: "session_heartbeat" })),
  );
  api.post(
    "/telemetry",
    handle(async () => ({ status: "accepted" })),
  );
  api.get(
    "/get_server_capabilities",
    handle(async () => ({
      supported_models: (await engines.current()).map((b) => ({
        model_name: b.id,
        max_context_length: b.config.maxPositions,
      })),
    })),
  );

  api.post(
    "/create_model",
    handle(async (req, _res, principal) => {
      const b = body(req);
      const baseName = b.base_model;
      if (typeof baseName !== "string" || baseName === "")
        throw invalid("base_model is required.", "base_model");
      const base = servedBase(baseName, await engines.current());
      if (!base)
        throw new InvalidInputError(
          `Base model ${quote(baseName)} is not served here (see get_server_capabilities).`,
          { code: "unsupported_base_model", param: "base_model" },
        );
      const lora = (b.lora_config ?? {}) as Body;
      const rank = lora.rank ?? 32;
      if (!(Number.isInteger(rank) && (rank as number) >= 1 && (rank as number) <= 256))
        throw invalid("lora_config.rank must be an integer from 1 to 256.", "lora_config.rank");
      const targets = targetsOf(lora);
      if (targets.length === 0)
        throw invalid(
          "lora_config trains nothing: set train_attn, train_mlp or train_unembed.",
          "lora_config",
        );
      const seed = lora.seed ?? null;
      if (seed !== null && !Number.isSafeInteger(seed))
        throw invalid("lora_config.seed must be an integer.", "lora_config.seed");
      const spec = {
        base_model: base.id,
        dtype: "bfloat16",
        lora_rank: rank as number,
        lora_target_modules: targets,
        seed: seed as number | null,
      };
      const entity = principal.defaultEntity;
      const request = {
        session_id: String(b.session_id ?? ""),
        model_seq_id: Number(b.model_seq_id ?? 0),
      };
      // A retry of the same create (its session and model_seq_id) finds the run it opened.
      const run = await store.trainingRuns.resolve({
        entity,
        request_id: `tinker:${request.session_id || randomUUID()}:${request.model_seq_id}`,
        fingerprint: fingerprint({ spec }),
        run_name: null,
        spec,
        initial: null,
      });
      await store.models.create(
        {
          entity,
          project: TINKER_PROJECT,
          name: modelName(run),
          base_model: base.id,
          initialCheckpoint: { step: 0, blob_key: null },
        },
        { returnExisting: true },
      );
      return { request_id: `model.${run.id}`, model_id: run.id };
    }),
  );

  api.post(
    "/forward_backward",
    handle(async (req, _res, principal) => {
      if (!Buffer.isBuffer(req.body))
        throw invalid(
          "forward_backward takes a protobuf body (Content-Type: application/x-protobuf), as SDK 0.25 sends it.",
        );
      if (req.header("content-encoding") && req.header("content-encoding") !== "identity")
        throw invalid("Compressed bodies are not read: the client config turns compression off.");
      const request = decodeForwardBackward(req.body);
      const run = await runOf(principal, request.modelId);
      const { config } = await ledger.baseOf((run.spec as { base_model: string }).base_model);
      const command = nativeForwardBackward(request, config.vocabSize);
      return submit(
        principal,
        run,
        request.forwardOnly ? "forward" : "forward_backward",
        request.seqId,
        command,
      );
    }),
  );

  api.post(
    "/optim_step",
    handle(async (req, _res, principal) => {
      const b = body(req);
      const run = await runOf(principal, b.model_id);
      const adam = (b.adam_params ?? {}) as Body;
      const num = (name: string, fallback: number, ok: (v: number) => boolean) => {
        const v = adam[name] ?? fallback;
        if (typeof v !== "number" || !Number.isFinite(v) || !ok(v))
          throw invalid(`adam_params.${name} is out of range: ${String(v)}`, `adam_params.${name}`);
        return v;
      };
      // Tinker's AdamParams defaults (AdamW, decoupled weight decay; a clip norm of 0 is off).
      const optimizer = {
        learning_rate: num("learning_rate", 1e-4, (v) => v >= 0 && v <= 10),
        beta1: num("beta1", 0.9, (v) => v >= 0 && v < 1),
        beta2: num("beta2", 0.95, (v) => v >= 0 && v < 1),
        eps: num("eps", 1e-12, (v) => v > 0 && v <= 1),
        weight_decay: num("weight_decay", 0, (v) => v >= 0 && v <= 10),
        grad_clip_norm: num("grad_clip_norm", 0, (v) => v >= 0 && v <= 1e6),
      };
      return submit(principal, run, "optim_step", b.seq_id, { optimizer });
    }),
  );

  const checkpointName = (value: unknown, param: string): string => {
    const plain =
      typeof value === "string" &&
      value.length >= 1 &&
      value.length <= 255 &&
      ![...value].some((c) => c === "/" || c.charCodeAt(0) < 32 || c.charCodeAt(0) === 127);
    if (!plain) throw invalid(`${param} must be a name of 1–255 characters without "/".`, param);
    return value as string;
  };
  const ttlOf = (value: unknown): number | null => {
    if (value === undefined || value === null) return null;
    if (!Number.isInteger(value) || (value as number) < 1)
      throw invalid("ttl_seconds must be a positive integer.", "ttl_seconds");
    return value as number;
  };

  api.post(
    "/save_weights",
    handle(async (req, _res, principal) => {
      const b = body(req);
      const run = await runOf(principal, b.model_id);
      const name = checkpointName(b.path, "path");
      return submit(principal, run, "save_state", b.seq_id, {
        checkpoint_name: name,
        ttl_seconds: ttlOf(b.ttl_seconds),
        overwrite: b.overwrite === true,
      });
    }),
  );

  api.post(
    "/save_weights_for_sampler",
    handle(async (req, _res, principal) => {
      const b = body(req);
      const run = await runOf(principal, b.model_id);
      const ephemeral = b.path === undefined || b.path === null;
      const name = ephemeral
        ? `sampling-session-${Number(b.sampling_session_seq_id ?? 0)}`
        : checkpointName(b.path, "path");
      return submit(
        principal,
        run,
        "save_weights_for_sampler",
        b.seq_id,
        {
          checkpoint_name: name,
          ttl_seconds: ttlOf(b.ttl_seconds),
          publication: {
            target: "saved_generation",
            model_alias: `${run.entity}/${TINKER_PROJECT}/${modelName(run)}`,
          },
        },
        ephemeral,
      );
    }),
  );

  /** A succeeded `save_state` of a run by the name it saved (`tinker://<run>/weights/<name>`). */
  const savedState = async (principal: Principal, path: unknown) => {
    const parsed = typeof path === "string" ? parseTinkerPath(path) : null;
    if (parsed?.kind !== "weights")
      throw invalid(`path ${quote(String(path))} is not tinker://<run>/weights/<name>.`, "path");
    const run = await findRun(store, principal, parsed.runId);
    // The newest save of the name (an overwrite replaced the older state). Tinker's routes never
    // release a result, so a save's stays in its row past the 24 hours a future is answered.
    const op = (await operationsOf(store, run)).findLast(
      (o) =>
        o.kind === "save_state" &&
        o.status === "succeeded" &&
        (o.body as Body).checkpoint_name === parsed.name,
    );
    if (!op) throw new NotFoundError(`Checkpoint ${quote(String(path))} not found.`);
    const result = JSON.parse(op.result ?? "{}") as { checkpoint?: { checkpoint_id?: string } };
    return { run, name: parsed.name, stateId: String(result.checkpoint?.checkpoint_id) };
  };

  api.post(
    "/load_weights",
    handle(async (req, _res, principal) => {
      const b = body(req);
      const run = await runOf(principal, b.model_id);
      const { stateId } = await savedState(principal, b.path);
      return submit(principal, run, "load_state", b.seq_id, {
        restore_optimizer: b.optimizer === true,
        source: { kind: "service_checkpoint", checkpoint_id: stateId },
      });
    }),
  );

  api.post(
    "/weights_info",
    handle(async (req, _res, principal) => {
      const path = body(req).tinker_path;
      const parsed = typeof path === "string" ? parseTinkerPath(path) : null;
      if (!parsed) throw invalid(`tinker_path ${quote(String(path))} is not a tinker:// path.`);
      const run = await findRun(store, principal, parsed.runId);
      const spec = run.spec as {
        base_model: string;
        lora_rank: number;
        lora_target_modules: string[];
      };
      const t = spec.lora_target_modules;
      return {
        base_model: spec.base_model,
        is_lora: true,
        lora_rank: spec.lora_rank,
        train_unembed: t.includes("lm_head"),
        train_mlp: t.includes("gate_proj"),
        train_attn: t.includes("q_proj"),
      };
    }),
  );

  api.post(
    "/get_info",
    handle(async (req, _res, principal) => {
      const run = await runOf(principal, body(req).model_id);
      const spec = run.spec as { base_model: string; lora_rank: number };
      return {
        model_id: run.id,
        model_data: { arch: "llama", model_name: spec.base_model, tokenizer_id: spec.base_model },
        is_lora: true,
        lora_rank: spec.lora_rank,
        model_name: spec.base_model,
        type: "get_info",
      };
    }),
  );

  const samples = new Map<string, SampleFuture>();

  /** The base and the loaded adapter (null: none) a sampler samples with; 404 for another
   * entity's run or a step it no longer has. */
  const samplerModel = async (principal: Principal, sampler: Sampler) => {
    if (sampler.kind === "base") {
      const base = await engines.find(sampler.baseId);
      if (!base) throw new TinkerError(404, `Base model ${quote(sampler.baseId)} is not served.`);
      return { baseId: base.id, adapter: null, modelPath: null };
    }
    const run = await findRun(store, principal, sampler.runId);
    const model = await store.models.getByName(run.entity, TINKER_PROJECT, modelName(run));
    const checkpoint =
      model && (await store.models.getCheckpoint(run.entity, model.id, sampler.step));
    if (!model || !checkpoint)
      throw new TinkerError(404, `Sampler weights of ${run.id} at step ${sampler.step} not found.`);
    const adapter = await engines.adapter(model.base_model, checkpoint, store.blobs);
    return { baseId: model.base_model, adapter, modelPath: null };
  };

  /** The step a named sampler save published (`tinker://<run>/sampler_weights/<name>`). */
  const samplerOfPath = async (principal: Principal, path: unknown): Promise<Sampler> => {
    const parsed = typeof path === "string" ? parseTinkerPath(path) : null;
    if (parsed?.kind !== "sampler_weights")
      throw invalid(
        `model_path ${quote(String(path))} is not tinker://<run>/sampler_weights/<name>.`,
        "model_path",
      );
    const run = await findRun(store, principal, parsed.runId);
    const op = (await operationsOf(store, run)).findLast(
      (o) =>
        o.kind === "save_weights_for_sampler" &&
        o.status === "succeeded" &&
        (o.body as Body).checkpoint_name === parsed.name,
    );
    const result = op && (JSON.parse(op.result ?? "{}") as { learner_version?: number });
    if (typeof result?.learner_version !== "number")
      throw new TinkerError(404, `Sampler weights ${quote(String(path))} not found.`);
    return { kind: "checkpoint", runId: run.id, step: result.learner_version };
  };

  api.post(
    "/create_sampling_session",
    handle(async (req, _res, principal) => {
      const b = body(req);
      let sampler: Sampler;
      if (typeof b.model_path === "string") sampler = await samplerOfPath(principal, b.model_path);
      else if (typeof b.base_model === "string") {
        const base = servedBase(b.base_model, await engines.current());
        if (!base)
          throw new InvalidInputError(`Base model ${quote(b.base_model)} is not served here.`, {
            code: "unsupported_base_model",
            param: "base_model",
          });
        sampler = { kind: "base", baseId: base.id };
      } else throw invalid("Give base_model or model_path.");
      return { sampling_session_id: samplerId(sampler), type: "create_sampling_session" };
    }),
  );

  api.get(
    "/samplers/:id",
    handle(async (req, _res, principal) => {
      const sampler = parseSamplerId(String(req.params.id));
      if (!sampler)
        throw new TinkerError(404, `Sampler ${quote(String(req.params.id))} not found.`);
      await samplerModel(principal, sampler);
      if (sampler.kind === "base")
        return { sampler_id: samplerId(sampler), base_model: sampler.baseId, model_path: null };
      const run = await findRun(store, principal, sampler.runId);
      return {
        sampler_id: samplerId(sampler),
        base_model: (run.spec as { base_model: string }).base_model,
        model_path: null,
      };
    }),
  );

  api.post(
    "/asample",
    handle(async (req, _res, principal) => {
      const b = body(req);
      const sampler =
        typeof b.sampling_session_id === "string" ? parseSamplerId(b.sampling_session_id) : null;
      if (!sampler)
        throw new TinkerError(
          404,
          `Sampling session ${quote(String(b.sampling_session_id))} not found.`,
        );
      const request = sampleRequest(b);
      const { baseId, adapter } = await samplerModel(principal, sampler);
      const thread = await engines.engine(baseId);
      const { config } = (await engines.find(baseId))!;
      for (const t of request.prompt)
        if (t < 0 || t >= config.vocabSize)
          throw new InvalidInputError(
            `prompt has token ${t}, outside the base model's vocabulary of ${config.vocabSize}.`,
            { code: "token_out_of_vocabulary" },
          );
      if (request.prompt.length >= config.maxPositions)
        throw invalid(
          `The prompt of ${request.prompt.length} tokens fills the ${config.maxPositions}-token context.`,
        );
      const run = async (): Promise<{ bytes: Uint8Array }> => {
        const sequences = Array.from({ length: request.n }, () => ({
          stopReason: "length" as SampledSequence["stopReason"],
          tokens: [] as number[],
          logprobs: [] as number[],
        }));
        for await (const event of thread.generate({
          prompt: request.prompt,
          n: request.n,
          maxTokens: request.maxTokens,
          temperature: request.temperature,
          topP: request.topP,
          topK: request.topK,
          minP: 0,
          repetitionPenalty: 1,
          presencePenalty: 0,
          frequencyPenalty: 0,
          ...(request.seed !== undefined ? { seed: request.seed } : {}),
          stop: request.stopStrings,
          stopTokenIds: request.stopTokens,
          keepStopToken: true,
          logprobs: true,
          adapter,
        })) {
          const s = sequences[event.choice]!;
          if (event.type === "token") s.logprobs.push(event.logprob?.logprob ?? Number.NaN);
          else {
            s.stopReason = event.finishReason;
            s.tokens = event.tokens;
          }
        }
        const prompt = request.promptLogprobs
          ? [...(await thread.promptLogprobs(request.prompt, adapter))]
          : null;
        return { bytes: encodeSampleResponse(sequences, prompt) };
      };
      const id = `sample.${randomUUID()}`;
      const done = run().catch((err: unknown) => ({
        error: `sample failed: ${(err as Error).message}`,
        category: "server",
      }));
      samples.set(id, { userId: principal.userId, done });
      setTimeout(() => samples.delete(id), SAMPLE_TTL_MS).unref();
      return {
        request_id: id,
        sample_sequence_ids: Array.from({ length: request.n }, () => randomUUID()),
      };
    }),
  );

  api.post(
    "/retrieve_future",
    handle(async (req, res, principal) => {
      const id = body(req).request_id;
      const future = typeof id === "string" ? parseFutureId(id) : null;
      if (!future) throw new TinkerError(404, `Future ${quote(String(id))} not found.`);
      if (future.kind === "sample") {
        const sample = samples.get(future.id);
        if (sample?.userId !== principal.userId)
          throw new TinkerError(404, `Future ${quote(String(id))} not found.`);
        let timer: NodeJS.Timeout | undefined;
        const waited = await Promise.race([
          sample.done,
          new Promise<null>((resolve) => {
            timer = setTimeout(() => resolve(null), LONG_POLL_MS);
          }),
        ]);
        clearTimeout(timer);
        if (waited === null) return { type: "try_again", request_id: id, queue_state: "active" };
        samples.delete(future.id);
        return "bytes" in waited ? waited.bytes : waited;
      }
      const run = await findRun(store, principal, future.runId);
      if (future.kind === "model") return { model_id: run.id, type: "create_model" };
      let closed = false;
      res.on("close", () => {
        closed = true;
      });
      const deadline = Date.now() + LONG_POLL_MS;
      let op = await store.trainingRuns.getOperation(run.id, future.opId);
      while (op && !ENDED.has(op.status) && Date.now() < deadline && !closed) {
        await new Promise((resolve) => setTimeout(resolve, POLL_EVERY_MS));
        op = await store.trainingRuns.getOperation(run.id, future.opId);
      }
      if (!op) throw new TinkerError(404, `Future ${quote(String(id))} not found.`);
      if (!ENDED.has(op.status))
        return { type: "try_again", request_id: id, queue_state: "active" };
      const accept = req.header("accept") ?? "";
      return futureResult(run, op, future.ephemeral, accept.includes("application/x-protobuf"));
    }),
  );

  // ---- the REST client's routes: runs, checkpoints, archives ---------------------------------

  /** A run's checkpoints as Tinker lists them, from its succeeded saves still live. */
  const checkpointsOf = async (run: TrainingRun) => {
    const model = await store.models.getByName(run.entity, TINKER_PROJECT, modelName(run));
    const out: TinkerCheckpoint[] = [];
    for (const op of await operationsOf(store, run)) {
      if (op.status !== "succeeded" || op.request_id.endsWith("-ephemeral")) continue;
      const name = String((op.body as Body).checkpoint_name);
      const result = JSON.parse(op.result ?? "{}") as {
        learner_version?: number;
        checkpoint?: { checkpoint_id?: string };
      };
      const time = new Date(op.ended_at ?? op.admitted_at).toISOString();
      if (op.kind === "save_state") {
        const state = await store.trainingRuns.getState(
          run.entity,
          String(result.checkpoint?.checkpoint_id),
        );
        if (!state) continue;
        out.push({
          checkpoint_id: `weights/${name}`,
          checkpoint_type: "training",
          time,
          tinker_path: `tinker://${run.id}/weights/${name}`,
          public: false,
          expires_at: state.expires_at === null ? null : new Date(state.expires_at).toISOString(),
          files: { kind: "state", state },
        });
      } else if (op.kind === "save_weights_for_sampler" && model) {
        const checkpoint = await store.models.getCheckpoint(
          run.entity,
          model.id,
          Number(result.learner_version),
        );
        if (!checkpoint) continue;
        out.push({
          checkpoint_id: `sampler_weights/${name}`,
          checkpoint_type: "sampler",
          time,
          tinker_path: `tinker://${run.id}/sampler_weights/${name}`,
          public: false,
          expires_at: null,
          files: { kind: "checkpoint", checkpoint, modelId: model.id },
        });
      }
    }
    // A name saved again lists once: its newest save.
    const byId = new Map(out.map((c) => [c.checkpoint_id, c]));
    return [...byId.values()];
  };
  const wireCheckpoint = ({ files: _files, ...c }: TinkerCheckpoint) => c;
  const trainingRunOf = async (run: TrainingRun, principal: Principal) => {
    const spec = run.spec as { base_model: string; lora_rank: number };
    const checkpoints = await checkpointsOf(run);
    const last = (type: string) =>
      checkpoints
        .filter((c) => c.checkpoint_type === type)
        .map(wireCheckpoint)
        .at(-1) ?? null;
    const ops = await store.trainingRuns.listOperations(run.id, { limit: 1 });
    return {
      training_run_id: run.id,
      base_model: spec.base_model,
      model_owner: principal.userName,
      is_lora: true,
      corrupted: run.status === "failed",
      lora_rank: spec.lora_rank,
      last_request_time: new Date(
        ops.data.at(-1)?.admitted_at ?? Number(run.created_at),
      ).toISOString(),
      last_checkpoint: last("training"),
      last_sampler_checkpoint: last("sampler"),
      user_metadata: null,
    };
  };
  const tinkerRun = async (principal: Principal, id: string) => {
    const run = await findRun(store, principal, id);
    if (!run.request_id.startsWith("tinker:"))
      throw new TinkerError(404, `Training run ${quote(id)} is not a Tinker run.`);
    return run;
  };

  api.get(
    "/training_runs",
    handle(async (req, _res, principal) => {
      const limit = Math.min(Math.max(Number(req.query.limit ?? 20) || 20, 1), 100);
      const offset = Math.max(Number(req.query.offset ?? 0) || 0, 0);
      const runs: TrainingRun[] = [];
      let after: string | undefined;
      for (;;) {
        const page = await store.trainingRuns.list(principal.entities, { after, limit: 100 });
        runs.push(...page.data.filter((r) => r.request_id.startsWith("tinker:")));
        if (!page.has_more || !page.last_id) break;
        after = page.last_id;
      }
      const slice = runs.slice(offset, offset + limit);
      return {
        training_runs: await Promise.all(slice.map((r) => trainingRunOf(r, principal))),
        cursor: { offset, limit, total_count: runs.length },
      };
    }),
  );
  api.get(
    "/training_runs/:id",
    handle(async (req, _res, principal) =>
      trainingRunOf(await tinkerRun(principal, String(req.params.id)), principal),
    ),
  );
  api.get(
    "/training_runs/:id/checkpoints",
    handle(async (req, _res, principal) => {
      const run = await tinkerRun(principal, String(req.params.id));
      const checkpoints = (await checkpointsOf(run)).map(wireCheckpoint);
      return {
        checkpoints,
        cursor: { offset: 0, limit: checkpoints.length, total_count: checkpoints.length },
      };
    }),
  );
  /** A checkpoint of a run by `weights/<name>` or `sampler_weights/<name>` (404 otherwise). */
  const checkpointOf = async (principal: Principal, runId: string, kind: string, name: string) => {
    const run = await tinkerRun(principal, runId);
    const found = (await checkpointsOf(run)).find((c) => c.checkpoint_id === `${kind}/${name}`);
    if (!found) throw new TinkerError(404, `Checkpoint ${kind}/${name} of ${run.id} not found.`);
    return { run, checkpoint: found };
  };
  /** `weights/<name>` as two path segments, or one with its `/` percent-encoded. */
  const checkpointParam = (req: Request) => {
    const params = req.params as Record<string, string>;
    if (params.kind !== undefined) return { kind: params.kind, name: String(params.name) };
    const [kind = "", ...rest] = String(params.cid).split("/");
    return { kind, name: rest.join("/") };
  };
  const CHECKPOINT_PATHS = [
    "/training_runs/:id/checkpoints/:kind/:name",
    "/training_runs/:id/checkpoints/:cid",
  ];
  api.delete(
    CHECKPOINT_PATHS,
    handle(async (req, res, principal) => {
      const { kind, name } = checkpointParam(req);
      const { run, checkpoint } = await checkpointOf(principal, String(req.params.id), kind, name);
      if (checkpoint.files.kind === "state") {
        await store.trainingRuns.expireState(run.entity, checkpoint.files.state.id);
      } else {
        // Sampler saves of one learner version are one checkpoint step: deleting it under one
        // name would take the weights of the others too, so that is refused, naming them.
        const { step } = checkpoint.files.checkpoint;
        const sharing = (await checkpointsOf(run))
          .filter(
            (c) =>
              c.files.kind === "checkpoint" &&
              c.files.checkpoint.step === step &&
              c.checkpoint_id !== checkpoint.checkpoint_id,
          )
          .map((c) => c.checkpoint_id);
        if (sharing.length > 0) {
          throw new TinkerError(
            400,
            `${checkpoint.checkpoint_id} holds the same weights as ${sharing.join(", ")} (no optim_step between the saves); delete none of them, or train on before saving again.`,
          );
        }
        await store.models.deleteCheckpoints(run.entity, checkpoint.files.modelId, [step]);
      }
      res.status(204).end();
      return undefined;
    }),
  );

  api.get(
    CHECKPOINT_PATHS.map((p) => `${p}/archive`),
    handle(async (req, _res, principal) => {
      const { kind, name } = checkpointParam(req);
      const { checkpoint } = await checkpointOf(principal, String(req.params.id), kind, name);
      const files =
        checkpoint.files.kind === "checkpoint"
          ? checkpoint.files.checkpoint
          : {
              step: checkpoint.files.state.learner_version,
              blob_key: checkpoint.files.state.state_key,
              created_at: Math.floor(checkpoint.files.state.created_at / 1000),
            };
      const token = randomUUID();
      const expires = Date.now() + ARCHIVE_TTL_MS;
      archives.set(token, { checkpoint: files, label: name, expires });
      setTimeout(() => archives.delete(token), ARCHIVE_TTL_MS).unref();
      return {
        url: `${req.protocol}://${req.get("host")}${TINKER_PREFIX}/archives/${token}`,
        expires: new Date(expires).toISOString(),
      };
    }),
  );

  api.use((_req: Request, _res: Response, next: NextFunction) =>
    next(new TinkerError(404, "Unknown path.")),
  );
  // The SDK retries 408, 409, 429 and 5xx for minutes, whatever `x-should-retry` says: a
  // refusal that retrying cannot change (a 409 of the ledger, a latest checkpoint) is answered
  // 400, which it raises at once (docs/tinker.md, "Run by hand with the real SDK").
  const refusal = (status: number) => (status === 409 ? 400 : status);
  router.use((err: unknown, _req: Request, res: Response, _next: NextFunction) => {
    if (err instanceof TinkerError) {
      res.status(refusal(err.status)).json({ detail: err.message });
      return;
    }
    // A JSON or protobuf body the parsers refused.
    const status = (err as { status?: number }).status;
    if (
      !(err instanceof DomainError) &&
      typeof status === "number" &&
      status >= 400 &&
      status < 500
    ) {
      res.status(status).json({ detail: (err as Error).message });
      return;
    }
    const { error, unexpected } = toApiError(err);
    if (unexpected) deps.logger.error({ err }, "tinker request failed");
    for (const [name, value] of Object.entries(error.headers)) res.setHeader(name, value);
    res.status(refusal(error.status)).json({
      detail: error.status === 500 ? "Internal server error." : error.message,
      ...(error.code ? { code: error.code } : {}),
    });
  });
  return router;
}

/** Every operation of a run, in sequence order. */
async function operationsOf(store: Store, run: TrainingRun): Promise<TrainingOperation[]> {
  const out: TrainingOperation[] = [];
  let after: string | undefined;
  for (;;) {
    const page = await store.trainingRuns.listOperations(run.id, { after, limit: 100 });
    out.push(...page.data);
    if (!page.has_more || !page.last_id) return out;
    after = page.last_id;
  }
}

/** Tinker's input names → the native rows (ADR 57's TokenMatrix), one target per position. */
const INPUT_ROWS: Readonly<Record<string, { row: string; dtype: "int64" | "float32" }>> = {
  target_tokens: { row: "target_token_ids", dtype: "int64" },
  weights: { row: "loss_weights", dtype: "float32" },
  logprobs: { row: "behavior_logprobs", dtype: "float32" },
  advantages: { row: "advantages", dtype: "float32" },
};
const LOSSES: Readonly<Record<string, { inputs: string[]; config: string[] }>> = {
  cross_entropy: { inputs: ["target_tokens"], config: [] },
  importance_sampling: { inputs: ["target_tokens", "logprobs", "advantages"], config: [] },
  ppo: {
    inputs: ["target_tokens", "logprobs", "advantages"],
    config: ["clip_low_threshold", "clip_high_threshold"],
  },
  cispo: {
    inputs: ["target_tokens", "logprobs", "advantages"],
    config: ["clip_low_threshold", "clip_high_threshold"],
  },
  dro: { inputs: ["target_tokens", "logprobs", "advantages"], config: ["beta"] },
};

/** A `ForwardBackwardRequest` as the native command: one matrix per datum, Tinker's loss summed
 * over every datum's positions, every position's log-prob returned. */
export function nativeForwardBackward(
  request: ForwardBackwardObject,
  vocabSize: number,
): Record<string, Json> {
  const loss = LOSSES[request.lossFn];
  if (!loss)
    throw new InvalidInputError(
      `loss_fn ${quote(request.lossFn)} is not one of ${Object.keys(LOSSES).join(", ")}.`,
      { code: "unsupported_loss", param: "loss_fn" },
    );
  const config: Record<string, Json> = {};
  for (const [key, value] of Object.entries(request.lossFnConfig ?? {})) {
    if (!loss.config.includes(key))
      throw new InvalidInputError(`loss_fn_config.${key} is not an option of ${request.lossFn}.`, {
        code: "invalid_loss_options",
        param: `loss_fn_config.${key}`,
      });
    config[key] = value;
  }
  if (request.data.length === 0) throw invalid("data is empty.", "data");
  const matrices = request.data.map((datum, i) => {
    const tokens: number[] = [];
    for (const chunk of datum.modelInput ?? []) {
      if (!chunk.encodedText)
        throw invalid(`data[${i}]: only encoded_text chunks are served (no images).`);
      tokens.push(...int32s(chunk.encodedText.tokens ?? new Uint8Array(), "tokens"));
    }
    const n = tokens.length;
    if (n === 0) throw invalid(`data[${i}].model_input is empty.`);
    for (const t of tokens)
      if (t < 0 || t >= vocabSize)
        throw new InvalidInputError(
          `data[${i}] has token ${t}, outside the base model's vocabulary of ${vocabSize}.`,
          { code: "token_out_of_vocabulary" },
        );
    const inputs = datum.lossFnInputs ?? {};
    for (const name of loss.inputs)
      if (!inputs[name])
        throw invalid(`data[${i}].loss_fn_inputs has no ${name}, which ${request.lossFn} needs.`);
    const rows: Json[] = [
      {
        name: "token_ids",
        dtype: "int64",
        shape: [n],
        values: { encoding: "dense", data: tokens },
      },
    ];
    for (const [name, tensor] of Object.entries(inputs)) {
      const target = INPUT_ROWS[name];
      if (!target || (!loss.inputs.includes(name) && name !== "weights"))
        throw invalid(`data[${i}].loss_fn_inputs.${name} is not an input of ${request.lossFn}.`);
      const values = tensorValues(tensor, name);
      if (values.length !== n)
        throw invalid(
          `data[${i}].loss_fn_inputs.${name} has ${values.length} values, model_input ${n} tokens.`,
        );
      rows.push({
        name: target.row,
        dtype: target.dtype,
        shape: [n, 1],
        values: { encoding: "dense", data: values },
      });
    }
    if (request.lossFn === "cross_entropy" && !inputs.weights)
      rows.push({
        name: "loss_weights",
        dtype: "float32",
        shape: [n, 1],
        values: { encoding: "spans", default: 1, spans: [] },
      });
    return { matrix_id: `datum-${i}`, rows };
  });
  return {
    batch: { matrices },
    loss: { name: request.lossFn, normalize_advantages: false, reduction: "sum", ...config },
    return_token_logprobs: true,
    retain_packed_input: false,
  };
}

/** The category Tinker's `RequestFailedError` carries, by the operation's error code. */
const categoryOf = (code: string | null) =>
  code === "execution_failed" ? "server" : code === "cancelled" ? "unknown" : "user";

/** An ended operation's answer to `retrieve_future`, as the SDK reads it. */
function futureResult(
  run: TrainingRun,
  op: TrainingOperation,
  ephemeral: boolean,
  protobufAccepted: boolean,
): unknown {
  if (op.status !== "succeeded")
    return {
      error: `${op.kind} ${op.status}: ${op.error_code ?? "unknown"}`,
      category: categoryOf(op.error_code),
    };
  const kept = keptResult(op);
  if (kept === null) throw new TinkerError(410, `The result of ${op.id} is no longer kept.`);
  const result = JSON.parse(kept) as Record<string, unknown>;
  const name = String((op.body as Body).checkpoint_name ?? "");
  switch (op.kind) {
    case "forward":
    case "forward_backward": {
      const logprobs = (result.token_logprobs as { data: string }[]).map((t) => {
        const bytes = Buffer.from(t.data, "base64");
        return new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
      });
      const metrics = { "loss:sum": op.loss ?? 0 };
      if (protobufAccepted) return encodeForwardBackwardOutput(logprobs, metrics);
      return {
        loss_fn_output_type: "ArrayRecord",
        loss_fn_outputs: logprobs.map((l) => ({
          logprobs: { data: [...l], dtype: "float32", shape: [l.length] },
        })),
        metrics,
      };
    }
    case "optim_step":
      return { metrics: {}, type: "optim_step" };
    case "save_state":
      return { path: `tinker://${run.id}/weights/${name}`, type: "save_weights" };
    case "save_weights_for_sampler":
      return ephemeral
        ? {
            sampling_session_id: `sampler.${run.id}.${String(result.learner_version)}`,
            type: "save_weights_for_sampler",
          }
        : { path: `tinker://${run.id}/sampler_weights/${name}`, type: "save_weights_for_sampler" };
    case "load_state":
      return { path: null, type: "load_weights" };
  }
}

/** An `asample` body read and checked (400 for what is not served or out of range). */
export function sampleRequest(b: Record<string, unknown>) {
  const prompt: number[] = [];
  const chunks = ((b.prompt ?? {}) as { chunks?: unknown }).chunks;
  if (!Array.isArray(chunks) || chunks.length === 0) throw invalid("prompt.chunks is required.");
  for (const chunk of chunks as Record<string, unknown>[]) {
    if (chunk.type !== undefined && chunk.type !== "encoded_text")
      throw invalid(`Only encoded_text chunks are served, not ${String(chunk.type)}.`);
    if (!Array.isArray(chunk.tokens) || !chunk.tokens.every((t) => Number.isInteger(t)))
      throw invalid("A chunk's tokens must be integers.");
    prompt.push(...(chunk.tokens as number[]));
  }
  if (prompt.length === 0) throw invalid("The prompt is empty.");
  const n = b.num_samples ?? 1;
  if (!Number.isInteger(n) || (n as number) < 1 || (n as number) > 128)
    throw invalid("num_samples must be an integer from 1 to 128.", "num_samples");
  if (Number(b.topk_prompt_logprobs ?? 0) > 0)
    throw new InvalidInputError("topk_prompt_logprobs is not served yet: send 0.", {
      code: "unsupported_value",
      param: "topk_prompt_logprobs",
    });
  const p = (b.sampling_params ?? {}) as Record<string, unknown>;
  const number = (name: string, fallback: number, ok: (v: number) => boolean) => {
    const v = p[name] ?? fallback;
    if (typeof v !== "number" || !Number.isFinite(v) || !ok(v))
      throw invalid(
        `sampling_params.${name} is out of range: ${String(v)}`,
        `sampling_params.${name}`,
      );
    return v;
  };
  const stop = p.stop ?? [];
  const stops = typeof stop === "string" ? [stop] : stop;
  if (!Array.isArray(stops)) throw invalid("sampling_params.stop must be a string or a list.");
  const stopStrings = stops.filter((x): x is string => typeof x === "string");
  const stopTokens = stops.filter((x): x is number => Number.isInteger(x));
  if (stopStrings.length + stopTokens.length !== stops.length)
    throw invalid("sampling_params.stop holds strings or token ids.", "sampling_params.stop");
  const seed = p.seed;
  if (seed !== undefined && seed !== null && !Number.isSafeInteger(seed))
    throw invalid("sampling_params.seed must be an integer.", "sampling_params.seed");
  const topK = number("top_k", -1, (v) => Number.isInteger(v) && v >= -1);
  return {
    prompt,
    n: n as number,
    maxTokens: number("max_tokens", 20, (v) => Number.isInteger(v) && v >= 1),
    temperature: number("temperature", 1, (v) => v >= 0 && v <= 100),
    topP: number("top_p", 1, (v) => v > 0 && v <= 1),
    // Tinker's -1 (and 0) is no top-k.
    topK: Math.max(topK, 0),
    seed: seed === undefined || seed === null ? undefined : (seed as number),
    stopStrings,
    stopTokens,
    promptLogprobs: b.prompt_logprobs === true,
  };
}
