import { HubError, pullModel, type WeightChoice } from "@arbor/engine/model";
import { ConflictError, ForbiddenError, InvalidInputError, UnavailableError } from "@arbor/store";
import type { Logger } from "pino";
import type { Handlers } from "../../http/operations.ts";

export interface BaseModelsDeps {
  /** Where base-model folders are (`ARBOR_BASE_MODELS_DIR`); a server always has one. */
  modelsDir: string | undefined;
  /** How the engines keep weights: what fits depends on it. */
  weights: WeightChoice;
  /** `HF_ENDPOINT` and `HF_TOKEN`. */
  hub: { endpoint: string; token: string | undefined };
  /** Scans the base models again, so a pulled one is served at once. */
  refresh: () => Promise<void>;
  logger: Logger;
}

/** Base models pulled from the Hugging Face Hub (ADR 48). */
export function baseModelsHandlers(deps: BaseModelsDeps): Handlers {
  return {
    pullBaseModel: async ({ body, principal }) => {
      // What the server stores for every tenant is an operator's to change, as /metrics is.
      if (!principal.operator)
        throw new ForbiddenError(
          "Only an operator key may pull base models (arbor keys create --operator).",
          {
            code: "permission_denied",
          },
        );
      const modelsDir = deps.modelsDir;
      if (!modelsDir) throw new Error("pullBaseModel: the engines have no base-models directory.");
      const asked = {
        repo: body.repo_id,
        revision: body.revision ?? undefined,
        id: body.id ?? undefined,
      };
      const log = deps.logger.child({ pull: { ...asked, endpoint: deps.hub.endpoint } });
      log.info("pulling a base model from the Hub");
      let result: Awaited<ReturnType<typeof pullModel>>;
      try {
        result = await pullModel({
          ...asked,
          modelsDir,
          weights: deps.weights,
          endpoint: deps.hub.endpoint,
          token: deps.hub.token,
          onEvent: (event) => {
            if (event.type === "resolved") log.info({ commit: event.commit }, "revision resolved");
            else if (event.type === "retry")
              log.warn({ file: event.path, attempt: event.attempt }, event.reason);
          },
        });
      } catch (err) {
        if (!(err instanceof HubError)) throw err;
        log.warn({ kind: err.kind }, err.message);
        throw domainError(err);
      }
      await deps.refresh();
      const { manifest } = result;
      log.info(
        { id: result.id, commit: manifest.commit, fetched: result.fetched },
        result.existing ? "base model already pulled" : "base model pulled",
      );
      return {
        id: result.id,
        object: "base_model" as const,
        repo_id: manifest.repo_id,
        revision: manifest.revision,
        commit: manifest.commit,
        endpoint: manifest.endpoint,
        files: manifest.files.map(({ path, size, sha256 }) => ({ path, size, sha256 })),
        bytes_fetched: result.fetched,
        already_present: result.existing,
        created_at: Math.floor(Date.parse(manifest.pulled_at) / 1000),
      };
    },
  };
}

/** The puller's failure as the API answers it (the spec's codes for pullBaseModel). */
function domainError(err: HubError): Error {
  const param = err.param ?? null;
  switch (err.kind) {
    case "invalid":
      return new InvalidInputError(err.message, { param });
    case "refused":
      return new InvalidInputError(err.message, { param, code: "unsupported_base_model" });
    case "not_found":
      return new InvalidInputError(err.message, { param, code: "hub_not_found" });
    case "access":
      return new InvalidInputError(err.message, { param, code: "hub_access_denied" });
    case "exists":
      return new ConflictError(err.message, { param, code: "base_model_exists" });
    case "busy":
      return new ConflictError(err.message, { param, code: "pull_in_progress" });
    case "checksum":
      return new UnavailableError(err.message, { code: "hub_checksum_mismatch" });
    case "network":
      return new UnavailableError(err.message, { code: "hub_unavailable" });
  }
}
