import {
  type DomainError,
  InvalidInputError,
  type Json,
  NotFoundError,
  type OperationKind,
  type Store,
  type TrainingRun,
} from "@arbor/store";
import { decodeBatch, learnerFromState, type WireBatch, type WireLoss } from "@arbor/training";
import type { Handlers } from "../../http/operations.ts";
import type { ProjectRef } from "../access.ts";
import type { EngineHost } from "../inference/engines.ts";
import {
  attempt,
  findOperation,
  findRun,
  fingerprint,
  keptResult,
  loadableState,
  modelOfAlias,
  operationNotFound,
  operationProgress,
  operationToWire,
  runToWire,
  serviceCheckpointId,
} from "./service.ts";

export interface TrainingRunsDeps {
  store: Store;
  engines: EngineHost;
  /** Told when a command was admitted, so an idle worker looks at once. */
  onAdmitted?: () => void;
}

type Body = Record<string, Json>;

/**
 * ADR 57's ledger, shared by the native API and Tinker's (ADR 71): `submit` admits one command
 * of a run; `baseOf` finds a served base model.
 */
export function runLedger(deps: TrainingRunsDeps) {
  const { store, engines } = deps;

  /** The base model's folder, which must be served (400 `unsupported_base_model`). */
  const baseOf = async (baseModel: string) => {
    const folder = await engines.find(baseModel);
    if (!folder)
      throw new InvalidInputError(`Base model ${baseModel} is not served here`, {
        code: "unsupported_base_model",
        param: "spec.base_model",
      });
    return folder;
  };

  /**
   * ADR 57's ledger for one command: an exact replay first, then the body checked in itself
   * (400), then, in one transaction, the run's state, the limits, the sequence, the open
   * gradients, and what the command names.
   */
  const submit = async (
    kind: OperationKind,
    runId: string,
    body: Body,
    principal: Parameters<typeof findRun>[1],
    project: ProjectRef,
  ) => {
    const run = await findRun(store, principal, runId);
    const print = fingerprint({ kind, body });
    const replayed = await store.trainingRuns.replay(run.id, String(body.request_id), print);
    if (replayed) return operationToWire(replayed);
    const { resolved, refusal } = await checkCommand(kind, run, body, project);
    const op = await store.trainingRuns.admit(run.id, {
      kind,
      request_id: String(body.request_id),
      fingerprint: print,
      sequence_id: Number(body.sequence_id),
      body,
      resolved,
      refusal,
    });
    deps.onAdmitted?.();
    return operationToWire(op);
  };

  /** Step 2 (400s, thrown) and step 7 (what the command names: kept as the refusal). */
  const checkCommand = async (
    kind: OperationKind,
    run: TrainingRun,
    body: Body,
    project: ProjectRef,
  ): Promise<{ resolved: Json; refusal: DomainError | null }> => {
    const spec = run.spec as { base_model: string };
    switch (kind) {
      case "forward":
      case "forward_backward": {
        if (body.retain_packed_input === true)
          throw new InvalidInputError("retain_packed_input is not supported: send false", {
            code: "invalid_value",
            param: "retain_packed_input",
          });
        const { config } = await baseOf(spec.base_model);
        decodeBatch(body.batch as unknown as WireBatch, body.loss as unknown as WireLoss, config);
        return { resolved: null, refusal: null };
      }
      case "save_weights_for_sampler": {
        const { model_alias } = body.publication as { model_alias: string };
        const { value, refusal } = await attempt(() =>
          modelOfAlias(store, run.entity, model_alias, run.spec as never),
        );
        return { resolved: value ? { ...value, entity: run.entity } : null, refusal };
      }
      case "save_state":
        return { resolved: { project: project.project }, refusal: null };
      case "load_state": {
        const id = serviceCheckpointId(body.source as never, "source");
        const { value, refusal } = await attempt(() =>
          loadableState(store, run.entity, id, run.spec as never),
        );
        return { resolved: value ? { state_key: value.state_key } : null, refusal };
      }
      default:
        return { resolved: null, refusal: null };
    }
  };

  return { submit, baseOf };
}

/** The native training API (ADR 57): the spec's `training-runs` operations. */
export function trainingRunsHandlers(deps: TrainingRunsDeps): Handlers {
  const { store } = deps;
  const { submit, baseOf } = runLedger(deps);
  return {
    listTrainingRuns: async ({ query, principal }) => {
      const page = await store.trainingRuns.list(principal.entities, {
        after: query.after,
        limit: query.limit ?? 20,
        status: query.status,
      });
      return { object: "list", ...page, data: page.data.map(runToWire) };
    },
    listTrainingOperations: async ({ params, query, principal }) => {
      const run = await findRun(store, principal, params.run_id);
      const page = await store.trainingRuns.listOperations(run.id, {
        after: query.after,
        limit: query.limit ?? 20,
      });
      return { object: "list", ...page, data: page.data.map(operationProgress) };
    },
    resolveTrainingRun: async ({ body, principal }) => {
      const entity = principal.defaultEntity;
      const runName = body.run_name ?? null;
      // A run the request or the name opened already is answered as it is (or 409): the
      // initial state is made only for a new one.
      let initial: { state_key: string; version: number } | null = null;
      if (!(await store.trainingRuns.getByRequest(entity, body.request_id))) {
        await baseOf(body.spec.base_model);
        const named = runName !== null && (await store.trainingRuns.getByName(entity, runName));
        if (!named && body.initial_state) {
          const id = serviceCheckpointId(body.initial_state.source, "initial_state.source");
          const state = await loadableState(store, entity, id, body.spec);
          const { stateKey } = await learnerFromState(
            store.blobs,
            state.state_key,
            state.run_id,
            state.learner_version,
            body.initial_state.restore_optimizer ?? false,
          );
          initial = { state_key: stateKey, version: state.learner_version };
        }
      }
      const run = await store.trainingRuns.resolve({
        entity,
        request_id: body.request_id,
        fingerprint: fingerprint(body),
        run_name: runName,
        spec: body.spec as Json,
        initial,
      });
      return runToWire(run);
    },
    retrieveTrainingRun: async ({ params, principal }) =>
      runToWire(await findRun(store, principal, params.run_id)),
    closeTrainingRun: async ({ params, principal }) => {
      const run = await findRun(store, principal, params.run_id);
      return runToWire(await store.trainingRuns.close(run.id));
    },
    createForwardOperation: ({ params, body, principal, project }) =>
      submit("forward", params.run_id, body as Body, principal, project),
    createForwardBackwardOperation: ({ params, body, principal, project }) =>
      submit("forward_backward", params.run_id, body as Body, principal, project),
    createOptimStepOperation: ({ params, body, principal, project }) =>
      submit("optim_step", params.run_id, body as Body, principal, project),
    createSaveWeightsForSamplerOperation: ({ params, body, principal, project }) =>
      submit("save_weights_for_sampler", params.run_id, body as Body, principal, project),
    createSaveStateOperation: ({ params, body, principal, project }) =>
      submit("save_state", params.run_id, body as Body, principal, project),
    createLoadStateOperation: ({ params, body, principal, project }) =>
      submit("load_state", params.run_id, body as Body, principal, project),
    retrieveTrainingOperation: async ({ params, principal }) => {
      const run = await findRun(store, principal, params.run_id);
      return operationToWire(await findOperation(store, run, params.operation_id));
    },
    cancelTrainingOperation: async ({ params, principal }) => {
      const run = await findRun(store, principal, params.run_id);
      const op = await store.trainingRuns.cancel(run.id, params.operation_id);
      if (!op) throw operationNotFound(run, params.operation_id);
      return operationToWire(op);
    },
    retrieveTrainingOperationResult: async ({ params, principal }) => {
      const run = await findRun(store, principal, params.run_id);
      const op = await findOperation(store, run, params.operation_id);
      const result = keptResult(op);
      if (result === null)
        throw new NotFoundError(`Operation ${op.id} has no result (released, expired or none).`, {
          code: "result_not_found",
        });
      return JSON.parse(result);
    },
    releaseTrainingOperationResult: async ({ params, body, principal }) => {
      const run = await findRun(store, principal, params.run_id);
      if (!(await store.trainingRuns.releaseResult(run.id, params.operation_id)))
        throw operationNotFound(run, params.operation_id);
      return { operation_id: params.operation_id, request_id: body.request_id, released: true };
    },
  };
}
