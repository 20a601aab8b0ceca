import type { UpstreamConfig } from "@arbor/config";
import type { components } from "@arbor/spec/schema";
import { type Checkpoint, type Model, NotFoundError, quote, type Store } from "@arbor/store";
import type { Principal } from "../access.ts";
import { checkpointName, parseFineTunedName } from "../fine-tuning/service.ts";
import type { EngineHost } from "./engines.ts";
import type { LlamaCppBackend } from "./llama-cpp.ts";

type ModelEntry = components["schemas"]["ModelEntry"];

/** What a `model` id in a request resolves to, by what serves it. `id` is the id that served,
 * answered as the completion's `model` (a trained alias resolves to its `…:step<N>`). */
export type ResolvedModel =
  /** The embedded engine: a base model, or a trained checkpoint's adapter over its base (a
   * checkpoint without files, step 0, is the base model itself). */
  | { kind: "engine"; id: string; baseId: string; checkpoint: Checkpoint | null }
  /** A user-supplied GGUF on llama.cpp. */
  | { kind: "llama"; id: string; backend: LlamaCppBackend }
  /** An OpenAI-compatible upstream: a base model it serves, or a trained checkpoint of one
   * (its adapter loaded there; a checkpoint without files is the base itself). */
  | {
      kind: "upstream";
      id: string;
      baseId: string;
      upstream: UpstreamConfig;
      checkpoint: Checkpoint | null;
    };

/** `<entity>/<project>/<name>` or `<entity>/<project>/<name>:step<N>`. */
const trainedId = /^([^/:\s]+)\/([^/:\s]+)\/([^/:\s]+)(?::step(\d+))?$/;

/** The scheme of the hosted API's artifact names, which its clients (OpenPipe ART's
 * `get_inference_name()`) chat with: `wandb-artifact:///<entity>/<project>/<name>[:step<N>]`. */
const ARTIFACT_SCHEME = "wandb-artifact:///";

/** A trained model's artifact name as its plain id; any other id as it is. The alias follows the
 * same tenant rules: it names the same model, so it finds what the plain id finds. */
export function plainModelId(id: string): string {
  if (!id.startsWith(ARTIFACT_SCHEME)) return id;
  const rest = id.slice(ARTIFACT_SCHEME.length);
  return trainedId.test(rest) ? rest : id;
}

/** Model ids (ADR 9, ADR 21): base ids from the catalogue; unknown (or another entity's) → 404. */
export class ModelDirectory {
  readonly #engines: EngineHost;
  /** A Map, not the config's object: a model named `toString` must not find Object's. */
  readonly #upstreams: ReadonlyMap<string, UpstreamConfig>;
  readonly #store: Store;

  constructor(engines: EngineHost, store: Store, upstreams: Record<string, UpstreamConfig> = {}) {
    this.#engines = engines;
    this.#store = store;
    this.#upstreams = new Map(Object.entries(upstreams));
  }

  async list(principal: Principal, options: { checkpoints?: boolean } = {}): Promise<ModelEntry[]> {
    const base = (id: string, created: number): ModelEntry => ({
      id,
      object: "model",
      created,
      owned_by: "system",
      root: id,
      parent: null,
    });
    const bases = await this.#engines.current();
    const engine = bases.map(({ id, created }) => base(id, created));
    const upstream = [...this.#upstreams.keys()]
      .filter((id) => !bases.some((b) => b.id === id))
      .map((id) => base(id, 0));
    const llama = [...this.#engines.llamaModels().keys()].map((id) => base(id, 0));
    return [
      ...engine,
      ...upstream,
      ...llama,
      ...(await this.#trained(principal, options.checkpoints ?? false)),
      ...(await this.#fineTuned(principal)),
    ];
  }

  /** The `ft:` names of the key's fine-tuning jobs that succeeded (ADR 70). */
  async #fineTuned(principal: Principal): Promise<ModelEntry[]> {
    const entries: ModelEntry[] = [];
    let after: string | undefined;
    for (;;) {
      const page = await this.#store.fineTuningJobs.list(principal.entities, { after, limit: 100 });
      for (const ft of page.data) {
        const job = await this.#store.jobs.get(ft.entity, ft.job_id);
        const model = job ? await this.#store.models.get(ft.entity, job.model_id) : undefined;
        if (job?.status !== "succeeded" || !model) continue;
        entries.push({
          id: ft.fine_tuned_model,
          object: "model",
          created: job.training_end ?? ft.created_at,
          owned_by: ft.entity,
          root: model.base_model,
          parent: `${model.entity}/${model.project}/${model.name}:step${job.step_to ?? 0}`,
        });
      }
      if (!page.has_more || !page.last_id) return entries;
      after = page.last_id;
    }
  }

  /** Each trained model the key can see as `<e>/<p>/<n>` (its latest checkpoint), and with
   * `checkpoints` also `…:step<N>` per live checkpoint. */
  async #trained(principal: Principal, checkpoints: boolean): Promise<ModelEntry[]> {
    const entries: ModelEntry[] = [];
    for (const model of await this.#models(principal)) {
      const alias = `${model.entity}/${model.project}/${model.name}`;
      const latest = `${alias}:step${model.latest_step ?? 0}`;
      entries.push({
        id: alias,
        object: "model",
        created: model.created_at,
        owned_by: model.entity,
        root: model.base_model,
        parent: latest,
      });
      if (!checkpoints) continue;
      for (const checkpoint of await this.#checkpoints(model)) {
        entries.push({
          id: `${alias}:step${checkpoint.step}`,
          object: "model",
          created: checkpoint.created_at,
          owned_by: model.entity,
          root: model.base_model,
          parent: alias,
        });
      }
    }
    return entries;
  }

  async #models(principal: Principal): Promise<Model[]> {
    const models: Model[] = [];
    let after: string | undefined;
    for (;;) {
      const page = await this.#store.models.list(principal.entities, { after, limit: 100 });
      models.push(...page.data);
      if (!page.has_more || !page.last_id) return models;
      after = page.last_id;
    }
  }

  async #checkpoints(model: Model): Promise<Checkpoint[]> {
    const checkpoints: Checkpoint[] = [];
    let after: string | undefined;
    for (;;) {
      const page = await this.#store.models.listCheckpoints(model.entity, model.id, {
        after,
        limit: 100,
        order: "asc",
      });
      checkpoints.push(...page.data);
      if (!page.has_more || !page.last_id) return checkpoints;
      after = page.last_id;
    }
  }

  /** Any id `list` gives, checkpoints (`…:step<N>`) included. */
  async retrieve(principal: Principal, asked: string): Promise<ModelEntry> {
    const fineTuned = parseFineTunedName(asked);
    if (fineTuned) {
      const resolved = await this.#resolveFineTuned(principal, asked, fineTuned);
      return {
        id: resolved.id,
        object: "model",
        created: resolved.checkpoint?.created_at ?? 0,
        owned_by: resolved.entity,
        root: resolved.baseId,
        parent: null,
      };
    }
    const id = plainModelId(asked);
    const entries = await this.list(principal, { checkpoints: /:step\d+$/.test(id) });
    const entry = entries.find((m) => m.id === id);
    if (!entry) throw modelNotFound(asked);
    return entry;
  }

  async resolve(principal: Principal, asked: string): Promise<ResolvedModel> {
    const id = plainModelId(asked);
    const upstream = this.#upstreams.get(id);
    if (upstream) return { kind: "upstream", id, baseId: id, upstream, checkpoint: null };
    const llama = this.#engines.llamaModels().get(id);
    if (llama) return { kind: "llama", id, backend: llama };
    const trained = trainedId.exec(id);
    if (trained) return this.#resolveTrained(principal, id, trained);
    const fineTuned = parseFineTunedName(id);
    if (fineTuned) return this.#resolveFineTuned(principal, id, fineTuned);
    const base = await this.#engines.find(id);
    if (!base) throw modelNotFound(id);
    return { kind: "engine", id, baseId: id, checkpoint: null };
  }

  /**
   * A fine-tuning job's model (ADR 70): `ft:…` is its last checkpoint once the job has
   * succeeded, `ft:…:ckpt-step-N` the checkpoint of the job's step N while it lives. Served as
   * the trained model's checkpoint, answered under the name asked.
   */
  async #resolveFineTuned(
    principal: Principal,
    id: string,
    name: { name: string; step: number | null },
  ): Promise<Exclude<ResolvedModel, { kind: "llama" }> & { entity: string }> {
    const ft = await this.#store.fineTuningJobs.byFineTunedModel(principal.entities, name.name);
    const job = ft ? await this.#store.jobs.get(ft.entity, ft.job_id) : undefined;
    if (!ft || !job) throw modelNotFound(id);
    if (name.step === null && job.status !== "succeeded") throw modelNotFound(id);
    const from = job.step_from ?? 0;
    const step = name.step === null ? (job.step_to ?? from) : from + name.step;
    if (name.step !== null && (name.step < 1 || (job.step_to !== null && step > job.step_to))) {
      throw modelNotFound(id);
    }
    const model = await this.#store.models.get(ft.entity, job.model_id);
    const checkpoint = model
      ? await this.#store.models.getCheckpoint(ft.entity, model.id, step)
      : undefined;
    if (!model || !checkpoint) throw modelNotFound(id);
    const served =
      name.step === null ? ft.fine_tuned_model : checkpointName(ft.fine_tuned_model, name.step);
    const entity = ft.entity;
    const upstream = this.#upstreams.get(model.base_model);
    if (upstream) {
      return {
        kind: "upstream",
        id: served,
        baseId: model.base_model,
        upstream,
        checkpoint,
        entity,
      };
    }
    return { kind: "engine", id: served, baseId: model.base_model, checkpoint, entity };
  }

  /** Another entity's model reads as unknown, exactly like a missing one. */
  async #resolveTrained(
    principal: Principal,
    id: string,
    match: RegExpExecArray,
  ): Promise<ResolvedModel> {
    const [, entity = "", project = "", name = "", step] = match;
    if (!principal.entities.includes(entity)) throw modelNotFound(id);
    const model = await this.#store.models.getByName(entity, project, name);
    if (!model) throw modelNotFound(id);
    const checkpoint = await this.#store.models.getCheckpoint(
      entity,
      model.id,
      step === undefined ? undefined : Number(step),
    );
    if (!checkpoint) throw modelNotFound(id);
    const served = `${entity}/${project}/${name}:step${checkpoint.step}`;
    // A base that an upstream serves serves its checkpoints there too (ADR 40).
    const upstream = this.#upstreams.get(model.base_model);
    if (upstream) {
      return { kind: "upstream", id: served, baseId: model.base_model, upstream, checkpoint };
    }
    return { kind: "engine", id: served, baseId: model.base_model, checkpoint };
  }
}

export function modelNotFound(id: string): NotFoundError {
  return new NotFoundError(
    `The model ${quote(id)} does not exist or you do not have access to it.`,
    { code: "model_not_found", param: "model" },
  );
}
