import {
  ArtContractError,
  checkOperation,
  checkRelease,
  checkResult,
  checkRun,
} from "./validate.ts";
import {
  type AdamConfig,
  type CheckpointSource,
  type Command,
  type ForwardBody,
  type LoadStateBody,
  type NativeTrainingRun,
  type Operation,
  type OperationKind,
  type OperationResult,
  type OptimStepBody,
  type ResultOf,
  type ResultRelease,
  type RunInitialState,
  type SaveStateBody,
  type SaveWeightsForSamplerBody,
  TERMINAL,
  type TokenMatrixBatch,
  type WireLoss,
  type WireRunSpec,
} from "./wire.ts";

/**
 * A client of the native training API as OpenPipe ART's is: `TrainingRuns` is its typed
 * transport (every answer checked as ART checks it), `RunClient` its `RemoteTrainingClient`
 * (gapless sequence ids, the projected learner version, operations polled every 0.1 s to their
 * end, then their result). Written from ART's code, not from Arbor's spec or server.
 */

/** A non-2xx answer: its status and the `error` object of the body (ART reads `body["error"]`). */
export class HttpError extends Error {
  override name = "HttpError";
  readonly status: number;
  readonly error: { message?: string; type?: string; param?: string | null; code?: string | null };
  readonly headers: Headers;
  constructor(status: number, body: unknown, headers: Headers) {
    const error =
      typeof body === "object" && body !== null && "error" in body
        ? (body as { error: HttpError["error"] }).error
        : { message: JSON.stringify(body) };
    super(`${status} ${error.code ?? error.type ?? ""}: ${error.message ?? ""}`);
    this.status = status;
    this.error = error;
    this.headers = headers;
  }
  get code(): string | null | undefined {
    return this.error.code;
  }
}

export class OperationFailed extends Error {
  override name = "OperationFailed";
  readonly operation: Operation;
  constructor(operation: Operation) {
    super(
      `remote training operation ${operation.operation_id} failed: ${JSON.stringify(operation.error)}`,
    );
    this.operation = operation;
  }
}

export class OperationCancelled extends Error {
  override name = "OperationCancelled";
}

/** ART's poll interval. */
export const POLL_MS = 100;

/** The typed transport, as ART's `TrainingRuns` (base URL with `/v1`, bearer key). */
export class TrainingRuns {
  readonly #base: string;
  readonly #key: string;

  constructor(serverUrl: string, apiKey: string) {
    this.#base = `${serverUrl}/v1`;
    this.#key = apiKey;
  }

  /** Any method and path under /v1, answering the parsed JSON or throwing an `HttpError`. */
  async request(method: "GET" | "POST", path: string, body?: unknown): Promise<unknown> {
    const response = await fetch(`${this.#base}${path}`, {
      method,
      headers: {
        authorization: `Bearer ${this.#key}`,
        ...(body === undefined ? {} : { "content-type": "application/json" }),
      },
      ...(body === undefined ? {} : { body: JSON.stringify(body) }),
    });
    const text = await response.text();
    let parsed: unknown = text;
    try {
      parsed = JSON.parse(text);
    } catch {
      // not JSON: kept as text for the error
    }
    if (!response.ok) throw new HttpError(response.status, parsed, response.headers);
    return parsed;
  }

  /** `POST /training/runs:resolve`: `run_name` only when given; the echo must be exact. */
  async resolve(options: {
    requestId: string;
    spec: WireRunSpec;
    runName?: string;
    initialState?: RunInitialState | null;
  }): Promise<NativeTrainingRun> {
    const spec = {
      ...options.spec,
      lora_target_modules: [...options.spec.lora_target_modules].sort(),
    };
    const body: Record<string, unknown> = {
      request_id: options.requestId,
      spec,
      initial_state: options.initialState ?? null,
    };
    if (options.runName !== undefined) body.run_name = options.runName;
    const run = checkRun(await this.request("POST", "/training/runs:resolve", body));
    if (run.run_name !== (options.runName ?? null) || !sameJson(run.spec, spec)) {
      throw new ArtContractError(
        `native training run identity changed during resolve: ${JSON.stringify(run)}`,
      );
    }
    return run;
  }

  async get(runId: string): Promise<NativeTrainingRun> {
    return checkRun(await this.request("GET", `/training/runs/${runId}`));
  }

  async submit(runId: string, command: Command): Promise<Operation> {
    return checkOperation(
      await this.request("POST", `/training/runs/${runId}/${command.kind}`, command.body),
    );
  }

  async operation(runId: string, operationId: string): Promise<Operation> {
    return checkOperation(
      await this.request("GET", `/training/runs/${runId}/operations/${operationId}`),
    );
  }

  /** `:cancel` has no body. */
  async cancel(runId: string, operationId: string): Promise<Operation> {
    return checkOperation(
      await this.request("POST", `/training/runs/${runId}/operations/${operationId}:cancel`),
    );
  }

  async result(runId: string, operationId: string): Promise<OperationResult> {
    return checkResult(
      await this.request("GET", `/training/runs/${runId}/operations/${operationId}/result`),
    );
  }

  async releaseResult(
    runId: string,
    operationId: string,
    requestId: string,
  ): Promise<ResultRelease> {
    return checkRelease(
      await this.request(
        "POST",
        `/training/runs/${runId}/operations/${operationId}/result:release`,
        { request_id: requestId },
      ),
    );
  }

  async close(runId: string, requestId: string): Promise<NativeTrainingRun> {
    return checkRun(
      await this.request("POST", `/training/runs/${runId}:close`, { request_id: requestId }),
    );
  }
}

function sameJson(a: unknown, b: unknown): boolean {
  return JSON.stringify(canonical(a)) === JSON.stringify(canonical(b));
}

function canonical(value: unknown): unknown {
  if (Array.isArray(value)) return value.map(canonical);
  if (typeof value === "object" && value !== null) {
    return Object.fromEntries(
      Object.entries(value)
        .sort(([a], [b]) => (a < b ? -1 : 1))
        .map(([k, v]) => [k, canonical(v)]),
    );
  }
  return value;
}

/** ART's `_operation_ref`: what must not change between an operation's answers. */
function refOf(op: Operation): string {
  return JSON.stringify([
    op.run_id,
    op.operation_id,
    op.sequence_id,
    op.learner_parent_version,
    op.reserved_output_learner_version,
    op.kind,
  ]);
}

/** One admitted operation (ART's `RemoteTrainingOperation`). */
export class RemoteOperation<K extends OperationKind> {
  readonly admitted: Operation;
  /** Every answer seen while polling, in order. */
  readonly seen: Operation[] = [];
  readonly #runs: TrainingRuns;
  #terminal: Promise<Operation> | undefined;

  constructor(runs: TrainingRuns, admitted: Operation) {
    this.#runs = runs;
    this.admitted = admitted;
    this.seen.push(admitted);
  }

  get id(): string {
    return this.admitted.operation_id;
  }

  /** Polls every 0.1 s until the operation has ended. */
  terminal(): Promise<Operation> {
    this.#terminal ??= (async () => {
      for (;;) {
        const op = await this.#runs.operation(this.admitted.run_id, this.id);
        if (refOf(op) !== refOf(this.admitted))
          throw new ArtContractError("remote operation identity changed");
        this.seen.push(op);
        if (TERMINAL.has(op.status)) return op;
        await new Promise((resolve) => setTimeout(resolve, POLL_MS));
      }
    })();
    return this.#terminal;
  }

  /** The result of the succeeded operation; `OperationFailed` or `OperationCancelled` else. */
  async result(): Promise<ResultOf[K]> {
    const op = await this.terminal();
    if (op.status === "failed") throw new OperationFailed(op);
    if (op.status === "cancelled")
      throw new OperationCancelled(`remote training operation ${this.id} was cancelled`);
    if (op.result_summary === null && op.result_ref === null)
      throw new ArtContractError("terminal operation has no successful result");
    const result = await this.#runs.result(op.run_id, this.id);
    if (result.operation_id !== this.id || result.kind !== op.kind)
      throw new ArtContractError("operation result identity changed");
    return result as ResultOf[K];
  }

  cancel(): Promise<Operation> {
    return this.#runs.cancel(this.admitted.run_id, this.id);
  }

  releaseResult(requestId: string): Promise<ResultRelease> {
    return this.#runs.releaseResult(this.admitted.run_id, this.id, requestId);
  }
}

/** The ART-side defaults of each command, before they are written onto the wire. */
export interface ForwardOptions {
  requestId: string;
  batch: TokenMatrixBatch;
  loss: WireLoss;
  collectPackingShapes?: boolean;
  returnTokenLogprobs?: boolean;
  sequenceId?: number;
}

/** ART's `NamedLossRequest` flattened: `normalize_advantages` defaults to true. */
export function wireLoss(
  name: WireLoss["name"],
  options: { normalizeAdvantages?: boolean; clipLow?: number; clipHigh?: number } = {},
): WireLoss {
  return {
    name,
    normalize_advantages: options.normalizeAdvantages ?? true,
    ...(options.clipLow === undefined ? {} : { clip_low_threshold: options.clipLow }),
    ...(options.clipHigh === undefined ? {} : { clip_high_threshold: options.clipHigh }),
  };
}

export function forwardBody(sequenceId: number, o: ForwardOptions): ForwardBody {
  return {
    request_id: o.requestId,
    sequence_id: sequenceId,
    batch: o.batch,
    loss: o.loss,
    collect_packing_shapes: o.collectPackingShapes ?? false,
    retain_packed_input: false,
    return_token_logprobs: o.returnTokenLogprobs ?? true,
  };
}

/** `AdamConfig` with ART's defaults; the backend sets only the learning rate. */
export function adam(learningRate: number, rest: Partial<AdamConfig> = {}): AdamConfig {
  return {
    learning_rate: learningRate,
    beta1: 0.9,
    beta2: 0.99,
    eps: 1e-13,
    weight_decay: 0.1,
    grad_clip_norm: 0.1,
    ...rest,
  };
}

/** `LoadStateRequest.checkpoint` as the wire adapter maps it to a source. */
export function checkpointSource(checkpoint: string): CheckpointSource {
  if (checkpoint.startsWith("wandb-artifact:"))
    return { kind: "wandb_artifact", artifact: checkpoint.slice("wandb-artifact:".length) };
  return {
    kind: "service_checkpoint",
    checkpoint_id: checkpoint.startsWith("service-checkpoint:")
      ? checkpoint.slice("service-checkpoint:".length)
      : checkpoint,
  };
}

/** ART's `RemoteTrainingClient`: one open run, its sequence and projected learner version. */
export class RunClient {
  readonly runs: TrainingRuns;
  readonly runId: string;
  #next: number;
  #projected: number;
  readonly #retained = new Map<
    string,
    { body: string; operation: RemoteOperation<OperationKind> }
  >();

  constructor(runs: TrainingRuns, run: NativeTrainingRun) {
    if (run.status !== "open") throw new Error(`remote training run is ${run.status}, not open`);
    this.runs = runs;
    this.runId = run.run_id;
    this.#next = run.next_sequence_id;
    this.#projected = run.projected_learner_version;
  }

  static async resolve(
    runs: TrainingRuns,
    options: Parameters<TrainingRuns["resolve"]>[0],
  ): Promise<RunClient> {
    return new RunClient(runs, await runs.resolve(options));
  }

  get nextSequenceId(): number {
    return this.#next;
  }

  get projectedLearnerVersion(): number {
    return this.#projected;
  }

  forward(o: ForwardOptions): Promise<RemoteOperation<"forward">> {
    return this.submit({ kind: "forward", body: forwardBody(o.sequenceId ?? this.#next, o) });
  }

  forwardBackward(o: ForwardOptions): Promise<RemoteOperation<"forward_backward">> {
    return this.submit({
      kind: "forward_backward",
      body: forwardBody(o.sequenceId ?? this.#next, o),
    });
  }

  optimStep(requestId: string, optimizer: AdamConfig): Promise<RemoteOperation<"optim_step">> {
    const body: OptimStepBody = { request_id: requestId, sequence_id: this.#next, optimizer };
    return this.submit({ kind: "optim_step", body });
  }

  /** `mode` is ART's `SamplerPublication.mode`: `versioned_lora` → `saved_generation`. */
  saveWeightsForSampler(o: {
    requestId: string;
    checkpointName: string;
    modelAlias: string;
    mode?: "versioned_lora" | "in_flight_lora";
    ttlSeconds?: number | null;
  }): Promise<RemoteOperation<"save_weights_for_sampler">> {
    const body: SaveWeightsForSamplerBody = {
      request_id: o.requestId,
      sequence_id: this.#next,
      checkpoint_name: o.checkpointName,
      ttl_seconds: o.ttlSeconds ?? null,
      publication: {
        target: o.mode === "in_flight_lora" ? "active" : "saved_generation",
        model_alias: o.modelAlias,
      },
    };
    return this.submit({ kind: "save_weights_for_sampler", body });
  }

  saveState(o: {
    requestId: string;
    checkpointName: string;
    ttlSeconds?: number | null;
    overwrite?: boolean;
  }): Promise<RemoteOperation<"save_state">> {
    const body: SaveStateBody = {
      request_id: o.requestId,
      sequence_id: this.#next,
      checkpoint_name: o.checkpointName,
      ttl_seconds: o.ttlSeconds ?? null,
      overwrite: o.overwrite ?? false,
    };
    return this.submit({ kind: "save_state", body });
  }

  loadState(o: {
    requestId: string;
    checkpoint: string;
    restoreOptimizer?: boolean;
  }): Promise<RemoteOperation<"load_state">> {
    const body: LoadStateBody = {
      request_id: o.requestId,
      sequence_id: this.#next,
      restore_optimizer: o.restoreOptimizer ?? false,
      source: checkpointSource(o.checkpoint),
    };
    return this.submit({ kind: "load_state", body });
  }

  /** ART's `_submit`: a replay is answered locally; the server must echo the command exactly. */
  async submit<C extends Command>(command: C): Promise<RemoteOperation<C["kind"]>> {
    const body = JSON.stringify(command.body);
    const prior = this.#retained.get(command.body.request_id);
    if (prior) {
      if (prior.body !== body) throw new Error("request_id was reused with different content");
      return prior.operation as RemoteOperation<C["kind"]>;
    }
    const sequenceId = command.body.sequence_id;
    if (sequenceId > this.#next)
      throw new Error(`expected sequence ${this.#next}, got ${sequenceId}`);
    const replay = sequenceId < this.#next;
    const admitted = await this.runs.submit(this.runId, command);
    if (
      admitted.run_id !== this.runId ||
      admitted.sequence_id !== sequenceId ||
      admitted.kind !== command.kind ||
      admitted.request_id !== command.body.request_id ||
      (!replay && admitted.learner_parent_version !== this.#projected)
    ) {
      throw new ArtContractError(
        `server admitted a divergent command: ${JSON.stringify(admitted)}`,
      );
    }
    const operation = new RemoteOperation<C["kind"]>(this.runs, admitted);
    this.#retained.set(command.body.request_id, { body, operation });
    if (!replay) {
      this.#next += 1;
      if (admitted.reserved_output_learner_version !== null)
        this.#projected = admitted.reserved_output_learner_version;
    }
    return operation;
  }

  close(requestId = `close-${crypto.randomUUID()}`): Promise<NativeTrainingRun> {
    return this.runs.close(this.runId, requestId);
  }
}
