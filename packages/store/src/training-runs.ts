import {
  type Clock,
  type Json,
  type JsonInput,
  type Page,
  type PageOptions,
  pageLimit,
  placeholders,
  toJson,
  toPage,
} from "./common.ts";
import { ConflictError, DomainError, isUniqueViolation, NotFoundError } from "./errors.ts";
import { uuidv7 } from "./ids.ts";
import { bool, json, num, numOrNull, type RowOf, rowSchema, str, strOrNull } from "./rows.ts";
import { inList, presentAmong, type Sql } from "./sql.ts";

/**
 * The native training API's ledger (ADR 57): runs, their sequenced operations, and the states
 * they save. Admission is one transaction that holds the run's row (FOR UPDATE on PostgreSQL;
 * SQLite's IMMEDIATE transaction excludes every other writer), so sequence ids stay gapless and
 * the limits hold under concurrent requests. Workers lease a run (as they lease jobs) and run
 * its operations one at a time in sequence order.
 */

export type RunStatus = "open" | "closing" | "closed" | "failed";
type OperationStatus = "admitted" | "running" | "succeeded" | "failed" | "cancelled";
export type OperationKind =
  | "forward"
  | "forward_backward"
  | "optim_step"
  | "save_weights_for_sampler"
  | "save_state"
  | "load_state";

/** At most this many operations of a run admitted or running (429). */
export const MAX_UNFINISHED_OPERATIONS = 128;
/** At most this many forward_backwards open (their gradients not yet applied). */
const MAX_OPEN_GRADIENTS = 64;
/** How long a result is kept after its operation ends, unless released. */
const RESULT_TTL_MS = 24 * 3600 * 1000;

/** The kinds whose failure (or cancel) fails their run: they change the learner state. */
const LEARNER_KINDS: ReadonlySet<OperationKind> = new Set([
  "forward_backward",
  "optim_step",
  "load_state",
]);

/** The `training_runs` table. */
const TRAINING_RUNS = rowSchema({
  id: str,
  entity: str,
  request_id: str,
  fingerprint: str,
  run_name: strOrNull,
  spec: json<Json>,
  status: str<RunStatus>,
  next_sequence_id: num,
  projected_version: num,
  committed_version: num,
  /** The blob prefix of the committed learner state (adapter, optimizer); null: fresh. */
  state_key: strOrNull,
  /** The blob key of the open gradient (the sum of the open forward_backwards'); null: none. */
  grad_key: strOrNull,
  created_at: num,
  lease_owner: strOrNull,
  lease_expires_at: numOrNull,
});
export interface TrainingRun extends RowOf<typeof TRAINING_RUNS> {}

/** The `training_operations` table. */
const TRAINING_OPERATIONS = rowSchema({
  id: str,
  run_id: str,
  request_id: str,
  fingerprint: str,
  sequence_id: num,
  kind: str<OperationKind>,
  /** The command's body as sent, and what admission resolved of it (a model, a saved state). */
  body: json<Json>,
  resolved: json<Json>,
  status: str<OperationStatus>,
  parent_version: num,
  reserved_version: numOrNull,
  /** Unix milliseconds. */
  admitted_at: num,
  started_at: numOrNull,
  ended_at: numOrNull,
  cancel_requested: bool,
  event_cursor: num,
  /** A forward_backward whose gradient no optim_step consumed yet. */
  open_gradient: bool,
  /** An optim_step: the forward_backwards it consumes, in sequence order. */
  contributes: json<string[]>,
  result: strOrNull,
  result_id: strOrNull,
  result_expires_at: numOrNull,
  error_code: strOrNull,
  /** A forward or forward_backward that succeeded: its loss (mean over active positions). */
  loss: numOrNull,
  /** A forward or forward_backward that succeeded: its active positions. */
  tokens: numOrNull,
});
export interface TrainingOperation extends RowOf<typeof TRAINING_OPERATIONS> {}

/** The `training_saved_states` table: learner states `save_state` kept, loadable by id. */
const TRAINING_STATES = rowSchema({
  id: str,
  entity: str,
  run_id: str,
  name: str,
  spec: json<Json>,
  learner_version: num,
  state_key: str,
  created_at: num,
  expires_at: numOrNull,
});
export interface TrainingState extends RowOf<typeof TRAINING_STATES> {}

export interface CreateRunInput {
  entity: string;
  request_id: string;
  fingerprint: string;
  run_name: string | null;
  spec: JsonInput;
  /** The state the run starts from (a saved state's), at its version. */
  initial: { state_key: string; version: number } | null;
}

export interface AdmitInput {
  kind: OperationKind;
  request_id: string;
  fingerprint: string;
  sequence_id: number;
  body: JsonInput;
  resolved?: JsonInput;
  /** A refusal of what the command names (step 7), raised after the ledger's own checks. */
  refusal?: DomainError | null;
}

/** What an operation's execution ended with. */
export type OperationOutcome =
  | {
      status: "succeeded";
      result: JsonInput;
      /** The run's new committed learner state, when it changed. */
      learner?: { version: number; state_key: string | null };
      /** The run's open gradient after it (undefined: unchanged). */
      grad_key?: string | null;
      /** What a forward or forward_backward measured, kept for the console past its result. */
      progress?: { loss: number; tokens: number };
    }
  | { status: "failed"; code: string }
  /** Stopped at a safe point after a cancel was asked: nothing of it is applied. */
  | { status: "cancelled" };

/** A 409 of the ledger: retrying cannot help (ART reads `x-should-retry: false`). */
function ledgerConflict(message: string, code: string, param?: string): ConflictError {
  return new ConflictError(message, { code, shouldRetry: false, ...(param ? { param } : {}) });
}

const lockRun = (tx: Sql) => (tx.dialect === "postgres" ? " FOR UPDATE" : "");

export class TrainingRunsRepo {
  readonly #sql: Sql;
  readonly #now: Clock;
  constructor(sql: Sql, now: Clock) {
    this.#sql = sql;
    this.#now = now;
  }

  async get(entity: string, runId: string): Promise<TrainingRun | undefined> {
    const row = await this.#sql.one(
      `SELECT ${TRAINING_RUNS.columns()} FROM training_runs WHERE entity = $1 AND id = $2`,
      [entity, runId],
    );
    return row ? TRAINING_RUNS.read(row) : undefined;
  }

  /** The runs of the given entities, newest first (ids are UUID v7), paged by `after`. */
  async list(
    entities: readonly string[],
    options: PageOptions & { status?: RunStatus } = {},
  ): Promise<Page<TrainingRun>> {
    const limit = pageLimit(options.limit);
    if (entities.length === 0) return toPage([], limit);
    const rows = await this.#sql.query(
      `SELECT ${TRAINING_RUNS.columns()} FROM training_runs
       WHERE entity IN (${placeholders(entities.length, 4)})
         AND (CAST($1 AS TEXT) IS NULL OR id < $1)
         AND (CAST($2 AS TEXT) IS NULL OR status = $2)
       ORDER BY id DESC LIMIT $3`,
      [options.after ?? null, options.status ?? null, limit + 1, ...entities],
    );
    return toPage(rows.map(TRAINING_RUNS.read), limit);
  }

  /** A run's operations in sequence order, paged by `after` (an operation id of the run). */
  async listOperations(runId: string, options: PageOptions = {}): Promise<Page<TrainingOperation>> {
    const limit = pageLimit(options.limit);
    const rows = await this.#sql.query(
      `SELECT ${TRAINING_OPERATIONS.columns("o")} FROM training_operations o
       WHERE o.run_id = $1
         AND (CAST($2 AS TEXT) IS NULL OR o.sequence_id >
              (SELECT a.sequence_id FROM training_operations a WHERE a.run_id = $1 AND a.id = $2))
       ORDER BY o.sequence_id LIMIT $3`,
      [runId, options.after ?? null, limit + 1],
    );
    return toPage(rows.map(TRAINING_OPERATIONS.read), limit);
  }

  /** Operations of every run admitted and running now (for the metrics' gauge). */
  async operationCounts(): Promise<{ admitted: number; running: number }> {
    const rows = await this.#sql.query(
      `SELECT status, COUNT(*) AS n FROM training_operations
       WHERE status IN ('admitted', 'running') GROUP BY status`,
    );
    const counts = { admitted: 0, running: 0 };
    for (const r of rows) counts[str(r.status) as keyof typeof counts] = num(r.n);
    return counts;
  }

  async getByRequest(
    entity: string,
    requestId: string,
    tx: Sql = this.#sql,
  ): Promise<TrainingRun | undefined> {
    return this.#runBy(tx, "request_id", entity, requestId);
  }

  async getByName(
    entity: string,
    runName: string,
    tx: Sql = this.#sql,
  ): Promise<TrainingRun | undefined> {
    return this.#runBy(tx, "run_name", entity, runName);
  }

  /**
   * Opens a run, or answers the one its `request_id` (same fingerprint) or `run_name` (same spec)
   * already opened; 409 `request_id_reused` or `run_name_conflict` else.
   */
  async resolve(input: CreateRunInput): Promise<TrainingRun> {
    for (let attempt = 0; ; attempt++) {
      try {
        return await this.#sql.transaction(async (tx) => {
          const byRequest = await this.getByRequest(input.entity, input.request_id, tx);
          if (byRequest) {
            if (byRequest.fingerprint !== input.fingerprint)
              throw ledgerConflict(
                `request_id ${input.request_id} opened a run with another body`,
                "request_id_reused",
                "request_id",
              );
            return byRequest;
          }
          if (input.run_name !== null) {
            const run = await this.getByName(input.entity, input.run_name, tx);
            if (run) {
              if (toJson(run.spec) !== toJson(input.spec))
                throw ledgerConflict(
                  `Run ${input.run_name} exists with another spec`,
                  "run_name_conflict",
                  "run_name",
                );
              return run;
            }
          }
          const now = this.#now();
          const version = input.initial?.version ?? 0;
          const row = await tx.one(
            `INSERT INTO training_runs (id, entity, request_id, fingerprint, run_name, spec, status,
               next_sequence_id, projected_version, committed_version, state_key, grad_key,
               created_at, lease_owner, lease_expires_at)
             VALUES ($1, $2, $3, $4, $5, $6, 'open', 0, $7, $7, $8, NULL, $9, NULL, NULL)
             RETURNING ${TRAINING_RUNS.columns()}`,
            [
              uuidv7(now),
              input.entity,
              input.request_id,
              input.fingerprint,
              input.run_name,
              toJson(input.spec),
              version,
              input.initial?.state_key ?? null,
              now,
            ],
          );
          return TRAINING_RUNS.read(row!);
        });
      } catch (err) {
        // Two resolves raced on one request_id or run_name: the second now finds the first's.
        if (attempt < 2 && isUniqueViolation(err)) continue;
        throw err;
      }
    }
  }

  async getOperation(
    runId: string,
    operationId: string,
    tx: Sql = this.#sql,
  ): Promise<TrainingOperation | undefined> {
    const row = await tx.one(
      `SELECT ${TRAINING_OPERATIONS.columns()} FROM training_operations WHERE run_id = $1 AND id = $2`,
      [runId, operationId],
    );
    return row ? TRAINING_OPERATIONS.read(row) : undefined;
  }

  async getOperationByRequest(
    runId: string,
    requestId: string,
    tx: Sql = this.#sql,
  ): Promise<TrainingOperation | undefined> {
    const row = await tx.one(
      `SELECT ${TRAINING_OPERATIONS.columns()} FROM training_operations
       WHERE run_id = $1 AND request_id = $2`,
      [runId, requestId],
    );
    return row ? TRAINING_OPERATIONS.read(row) : undefined;
  }

  /** An exact replay's operation; 409 `request_id_reused` for other content under its id. */
  async replay(
    runId: string,
    requestId: string,
    fingerprint: string,
    tx: Sql = this.#sql,
  ): Promise<TrainingOperation | undefined> {
    const op = await this.getOperationByRequest(runId, requestId, tx);
    if (op && op.fingerprint !== fingerprint)
      throw ledgerConflict(
        `request_id ${requestId} was admitted with another body`,
        "request_id_reused",
        "request_id",
      );
    return op;
  }

  /** Admits a command (ADR 57's checks 1 and 3–7, in that order), in one transaction. */
  async admit(runId: string, input: AdmitInput): Promise<TrainingOperation> {
    return this.#sql.transaction(async (tx) => {
      const run = await this.#lockedRun(tx, runId);
      const replayed = await this.replay(runId, input.request_id, input.fingerprint, tx);
      if (replayed) return replayed;
      if (run.status === "failed")
        throw ledgerConflict(`Training run ${runId} failed`, "run_failed");
      if (run.status !== "open")
        throw ledgerConflict(`Training run ${runId} is ${run.status}`, "run_closed");
      const unfinished = await this.#unfinished(tx, runId);
      if (unfinished >= MAX_UNFINISHED_OPERATIONS)
        throw new DomainError(
          "rate_limited",
          `Training run ${runId} has ${unfinished} unfinished operations, the most it takes`,
          { code: "too_many_unfinished_commands", retryAfterSeconds: 1 },
        );
      if (input.sequence_id !== run.next_sequence_id)
        throw ledgerConflict(
          `sequence_id ${input.sequence_id} is not the next one: ${run.next_sequence_id} is expected`,
          "sequence_gap",
          "sequence_id",
        );
      const open = (
        await tx.query(
          `SELECT id FROM training_operations WHERE run_id = $1 AND open_gradient = 1
           ORDER BY sequence_id`,
          [runId],
        )
      ).map((r) => str(r.id));
      if (input.kind === "forward_backward" && open.length >= MAX_OPEN_GRADIENTS)
        throw ledgerConflict(
          `Training run ${runId} has ${open.length} open gradients, the most it takes: send an optim_step`,
          "too_many_open_gradients",
        );
      if (input.kind === "optim_step" && open.length === 0)
        throw ledgerConflict(
          `Training run ${runId} has no open gradient to apply`,
          "no_open_gradients",
        );
      if (input.kind === "load_state" && open.length > 0)
        throw ledgerConflict(
          `Training run ${runId} has ${open.length} open gradients: apply them before load_state`,
          "open_gradients",
        );
      if (input.refusal) throw input.refusal;
      const transition = input.kind === "optim_step" || input.kind === "load_state";
      const parent = run.projected_version;
      const now = this.#now();
      const id = uuidv7(now);
      const contributes = input.kind === "optim_step" ? open : [];
      const row = await tx.one(
        `INSERT INTO training_operations (id, run_id, request_id, fingerprint, sequence_id, kind,
           body, resolved, status, parent_version, reserved_version, admitted_at, started_at,
           ended_at, cancel_requested, event_cursor, open_gradient, contributes, result,
           result_id, result_expires_at, error_code, loss, tokens)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'admitted', $9, $10, $11, NULL, NULL, 0, 1, $12,
           $13, NULL, NULL, NULL, NULL, NULL, NULL)
         RETURNING ${TRAINING_OPERATIONS.columns()}`,
        [
          id,
          runId,
          input.request_id,
          input.fingerprint,
          input.sequence_id,
          input.kind,
          toJson(input.body),
          toJson(input.resolved ?? null),
          parent,
          transition ? parent + 1 : null,
          now,
          input.kind === "forward_backward" ? 1 : 0,
          toJson(contributes),
        ],
      );
      if (contributes.length > 0)
        await tx.exec(
          "UPDATE training_operations SET open_gradient = 0 WHERE run_id = $1 AND open_gradient = 1",
          [runId],
        );
      await tx.exec(
        `UPDATE training_runs SET next_sequence_id = next_sequence_id + 1,
           projected_version = $2 WHERE id = $1`,
        [runId, transition ? parent + 1 : parent],
      );
      return TRAINING_OPERATIONS.read(row!);
    });
  }

  /** Refuses new commands; the admitted ones still run (`closing`, then `closed`). */
  async close(runId: string): Promise<TrainingRun> {
    return this.#sql.transaction(async (tx) => {
      const run = await this.#lockedRun(tx, runId);
      if (run.status === "open") {
        const status = (await this.#unfinished(tx, runId)) > 0 ? "closing" : "closed";
        await tx.exec("UPDATE training_runs SET status = $2 WHERE id = $1", [runId, status]);
      }
      return this.#lockedRun(tx, runId);
    });
  }

  /**
   * Cancels an admitted operation (a learner kind fails its run), flags a running one (its worker
   * stops it at its next safe point, `cancelRequested`), and leaves an ended one as it is.
   */
  async cancel(runId: string, operationId: string): Promise<TrainingOperation | undefined> {
    return this.#sql.transaction(async (tx) => {
      await this.#lockedRun(tx, runId);
      const op = await this.getOperation(runId, operationId, tx);
      if (!op) return undefined;
      if (op.status === "running") {
        await tx.exec(
          `UPDATE training_operations SET cancel_requested = 1, event_cursor = event_cursor + 1
           WHERE id = $1 AND cancel_requested = 0`,
          [op.id],
        );
      } else if (op.status === "admitted") {
        await tx.exec("UPDATE training_operations SET cancel_requested = 1 WHERE id = $1", [op.id]);
        await this.#end(tx, op, "cancelled", "cancelled");
      }
      return this.getOperation(runId, operationId, tx);
    });
  }

  /** Whether a cancel of the operation was asked (the executor reads it at its safe points). */
  async cancelRequested(operationId: string): Promise<boolean> {
    const row = await this.#sql.one(
      "SELECT cancel_requested FROM training_operations WHERE id = $1",
      [operationId],
    );
    return row !== undefined && bool(row.cancel_requested);
  }

  /** Drops a result (idempotent); false when the operation is unknown. */
  async releaseResult(runId: string, operationId: string): Promise<boolean> {
    const n = await this.#sql.exec(
      `UPDATE training_operations SET result = NULL, result_id = NULL, result_expires_at = NULL
       WHERE run_id = $1 AND id = $2`,
      [runId, operationId],
    );
    return n > 0;
  }

  // ---- saved states ----------------------------------------------------------------------------

  async getState(entity: string, stateId: string): Promise<TrainingState | undefined> {
    const row = await this.#sql.one(
      `SELECT ${TRAINING_STATES.columns()} FROM training_saved_states
       WHERE entity = $1 AND id = $2 AND (expires_at IS NULL OR expires_at > $3)`,
      [entity, stateId, this.#now()],
    );
    return row ? TRAINING_STATES.read(row) : undefined;
  }

  /**
   * Expires a saved state now (Tinker's checkpoint delete, ADR 71): it reads as gone at once, and
   * the blob sweep deletes its files as for any expired state. Answers whether it was live.
   */
  async expireState(entity: string, stateId: string): Promise<boolean> {
    const now = this.#now();
    const changed = await this.#sql.exec(
      `UPDATE training_saved_states SET expires_at = $3
       WHERE entity = $1 AND id = $2 AND (expires_at IS NULL OR expires_at > $3)`,
      [entity, stateId, now],
    );
    return changed > 0;
  }

  /**
   * Records a saved state under a new id. A name the run saved before is 409 unless
   * `overwrite`, which drops the older one.
   */
  async saveState(input: {
    entity: string;
    run_id: string;
    name: string;
    spec: JsonInput;
    learner_version: number;
    state_key: string;
    ttl_ms: number | null;
    overwrite: boolean;
  }): Promise<TrainingState> {
    return this.#sql.transaction(async (tx) => {
      const now = this.#now();
      const existing = await tx.one(
        `SELECT id FROM training_saved_states WHERE run_id = $1 AND name = $2`,
        [input.run_id, input.name],
      );
      if (existing) {
        if (!input.overwrite)
          throw new ConflictError(`The run saved a state named ${input.name} before`, {
            code: "operation_conflict",
          });
        await tx.exec("DELETE FROM training_saved_states WHERE id = $1", [str(existing.id)]);
      }
      const row = await tx.one(
        `INSERT INTO training_saved_states (id, entity, run_id, name, spec, learner_version,
           state_key, created_at, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING ${TRAINING_STATES.columns()}`,
        [
          uuidv7(now),
          input.entity,
          input.run_id,
          input.name,
          toJson(input.spec),
          input.learner_version,
          input.state_key,
          now,
          input.ttl_ms === null ? null : now + input.ttl_ms,
        ],
      );
      return TRAINING_STATES.read(row!);
    });
  }

  // ---- execution -------------------------------------------------------------------------------

  /**
   * Leases to `workerId` a run with an admitted operation whose lease is free (or lapsed, or
   * already this worker's), and answers it. A run found with an operation still `running` under
   * a lapsed lease lost its worker mid-operation: that operation fails (`execution_failed`),
   * never half-applied, with its effect on the run.
   */
  async claimRun(workerId: string, leaseMs: number): Promise<TrainingRun | undefined> {
    return this.#sql.transaction(async (tx) => {
      const now = this.#now();
      const skip = tx.dialect === "postgres" ? " FOR UPDATE OF r SKIP LOCKED" : "";
      const row = await tx.one(
        `SELECT ${TRAINING_RUNS.columns("r")} FROM training_runs r
         WHERE (r.lease_owner IS NULL OR r.lease_owner = $1 OR r.lease_expires_at < $2)
           AND EXISTS (SELECT 1 FROM training_operations o
                       WHERE o.run_id = r.id AND o.status IN ('admitted', 'running'))
         ORDER BY r.id LIMIT 1${skip}`,
        [workerId, now],
      );
      if (!row) return undefined;
      const run = TRAINING_RUNS.read(row);
      if (run.lease_owner !== workerId) {
        const stranded = await tx.query(
          `SELECT ${TRAINING_OPERATIONS.columns()} FROM training_operations
           WHERE run_id = $1 AND status = 'running'`,
          [run.id],
        );
        for (const op of stranded.map(TRAINING_OPERATIONS.read))
          await this.#end(tx, op, "failed", "execution_failed");
      }
      await tx.exec(
        "UPDATE training_runs SET lease_owner = $2, lease_expires_at = $3 WHERE id = $1",
        [run.id, workerId, now + leaseMs],
      );
      return this.#lockedRun(tx, run.id);
    });
  }

  /** Extends the lease; false when the run is no longer this worker's. */
  async renewLease(workerId: string, runId: string, leaseMs: number): Promise<boolean> {
    const n = await this.#sql.exec(
      "UPDATE training_runs SET lease_expires_at = $3 WHERE id = $1 AND lease_owner = $2",
      [runId, workerId, this.#now() + leaseMs],
    );
    return n > 0;
  }

  async releaseLease(workerId: string, runId: string): Promise<void> {
    await this.#sql.exec(
      `UPDATE training_runs SET lease_owner = NULL, lease_expires_at = NULL
       WHERE id = $1 AND lease_owner = $2`,
      [runId, workerId],
    );
  }

  /** The run's next operation to execute (its lowest admitted), once none is running. */
  async nextOperation(runId: string): Promise<TrainingOperation | undefined> {
    const row = await this.#sql.one(
      `SELECT ${TRAINING_OPERATIONS.columns()} FROM training_operations
       WHERE run_id = $1 AND status IN ('admitted', 'running') ORDER BY sequence_id LIMIT 1`,
      [runId],
    );
    const op = row ? TRAINING_OPERATIONS.read(row) : undefined;
    return op?.status === "admitted" ? op : undefined;
  }

  /**
   * Marks an admitted operation running under the run's lease, and answers the run as it is;
   * undefined when the operation is not admitted or the lease not the worker's.
   */
  async startOperation(workerId: string, op: TrainingOperation): Promise<TrainingRun | undefined> {
    return this.#sql.transaction(async (tx) => {
      const run = await this.#lockedRun(tx, op.run_id);
      if (run.lease_owner !== workerId) return undefined;
      const n = await tx.exec(
        `UPDATE training_operations SET status = 'running', started_at = $2,
           event_cursor = event_cursor + 1 WHERE id = $1 AND status = 'admitted'`,
        [op.id, this.#now()],
      );
      return n > 0 ? run : undefined;
    });
  }

  /**
   * Of these learner blob keys (state prefixes, gradient keys), the ones still named: a run's
   * committed state or open gradient, or a saved state that has not expired. The others are
   * superseded and may be deleted.
   */
  async referencedLearnerKeys(keys: readonly string[]): Promise<Set<string>> {
    const d = this.#sql.dialect;
    return presentAmong(
      this.#sql,
      `SELECT state_key AS value FROM training_runs WHERE ${inList(d, "state_key", 1)}
       UNION SELECT grad_key AS value FROM training_runs WHERE ${inList(d, "grad_key", 1)}
       UNION SELECT state_key AS value FROM training_saved_states
         WHERE ${inList(d, "state_key", 1)}
           AND (expires_at IS NULL OR expires_at > ${Math.floor(this.#now())})`,
      keys,
    );
  }

  /** Ends a running operation with its outcome, and the run with it, in one transaction. */
  async finishOperation(
    workerId: string,
    op: TrainingOperation,
    outcome: OperationOutcome,
  ): Promise<TrainingOperation | undefined> {
    return this.#sql.transaction(async (tx) => {
      const run = await this.#lockedRun(tx, op.run_id);
      const current = await this.getOperation(op.run_id, op.id, tx);
      if (run.lease_owner !== workerId || current?.status !== "running") return undefined;
      if (outcome.status === "failed") {
        await this.#end(tx, current, "failed", outcome.code);
      } else if (outcome.status === "cancelled") {
        await this.#end(tx, current, "cancelled", "cancelled");
      } else {
        const now = this.#now();
        const text = toJson(outcome.result);
        await tx.exec(
          `UPDATE training_operations SET status = 'succeeded', ended_at = $2,
             event_cursor = event_cursor + 1, result = $3, result_id = $4,
             result_expires_at = $5, loss = $6, tokens = $7 WHERE id = $1`,
          [
            op.id,
            now,
            text,
            uuidv7(now),
            now + RESULT_TTL_MS,
            outcome.progress?.loss ?? null,
            outcome.progress?.tokens ?? null,
          ],
        );
        if (outcome.learner)
          await tx.exec(
            "UPDATE training_runs SET committed_version = $2, state_key = $3 WHERE id = $1",
            [op.run_id, outcome.learner.version, outcome.learner.state_key],
          );
        if (outcome.grad_key !== undefined)
          await tx.exec("UPDATE training_runs SET grad_key = $2 WHERE id = $1", [
            op.run_id,
            outcome.grad_key,
          ]);
        await this.#settleClosing(tx, op.run_id);
      }
      return this.getOperation(op.run_id, op.id, tx);
    });
  }

  /** The entity's run whose `column` is `value`. */
  async #runBy(
    tx: Sql,
    column: "request_id" | "run_name",
    entity: string,
    value: string,
  ): Promise<TrainingRun | undefined> {
    const row = await tx.one(
      `SELECT ${TRAINING_RUNS.columns()} FROM training_runs WHERE entity = $1 AND ${column} = $2`,
      [entity, value],
    );
    return row ? TRAINING_RUNS.read(row) : undefined;
  }

  async #lockedRun(tx: Sql, runId: string): Promise<TrainingRun> {
    const row = await tx.one(
      `SELECT ${TRAINING_RUNS.columns()} FROM training_runs WHERE id = $1${lockRun(tx)}`,
      [runId],
    );
    if (!row) throw new NotFoundError(`Training run ${runId} not found`);
    return TRAINING_RUNS.read(row);
  }

  async #unfinished(tx: Sql, runId: string): Promise<number> {
    const row = await tx.one(
      `SELECT COUNT(*) AS n FROM training_operations
       WHERE run_id = $1 AND status IN ('admitted', 'running')`,
      [runId],
    );
    return num(row?.n);
  }

  /** A closing run whose operations all ended is closed. */
  async #settleClosing(tx: Sql, runId: string): Promise<void> {
    if ((await this.#unfinished(tx, runId)) === 0)
      await tx.exec(
        "UPDATE training_runs SET status = 'closed' WHERE id = $1 AND status = 'closing'",
        [runId],
      );
  }

  /**
   * Ends an operation without success. A learner kind fails its run, and every operation
   * admitted after it, which counted on a learner state that will not exist.
   */
  async #end(
    tx: Sql,
    op: TrainingOperation,
    status: "failed" | "cancelled",
    code: string | null,
  ): Promise<void> {
    const now = this.#now();
    await tx.exec(
      `UPDATE training_operations SET status = $2, ended_at = $3, error_code = $4,
         event_cursor = event_cursor + 1, open_gradient = 0 WHERE id = $1`,
      [op.id, status, now, code],
    );
    if (LEARNER_KINDS.has(op.kind)) {
      await tx.exec("UPDATE training_runs SET status = 'failed' WHERE id = $1", [op.run_id]);
      await tx.exec(
        `UPDATE training_operations SET status = 'failed', ended_at = $3,
           error_code = 'execution_failed', event_cursor = event_cursor + 1, open_gradient = 0
         WHERE run_id = $1 AND status = 'admitted' AND sequence_id > $2`,
        [op.run_id, op.sequence_id, now],
      );
    } else {
      await this.#settleClosing(tx, op.run_id);
    }
  }
}
