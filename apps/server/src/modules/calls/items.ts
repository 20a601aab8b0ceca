import type { components } from "@arbor/spec/schema";
import { Ajv2020, type ErrorObject, type ValidateFunction } from "ajv/dist/2020.js";
import addFormats from "ajv-formats";
import { toApiError, type ValidationIssue } from "../../http/errors.ts";
import { loadSpec, type OpenApiDocument } from "../../http/openapi.ts";

type Schemas = components["schemas"];

/**
 * The spec marks an array `x-validate-items-separately` (upsertCallBatch's `batch`) when one bad
 * item must not refuse the others. The request validator then gets a copy of the document
 * whose marked arrays take any items (their own bounds stay), and the operation checks each
 * item against the spec's item schema itself (`checkBatchItem`), answering per item.
 */
export function withItemsValidatedSeparately<T extends OpenApiDocument>(spec: T): T {
  const visit = (node: unknown): void => {
    if (typeof node !== "object" || node === null) return;
    const schema = node as Record<string, unknown>;
    if (schema["x-validate-items-separately"] === true && "items" in schema) {
      schema.items = {};
      return;
    }
    for (const child of Object.values(schema)) visit(child);
  };
  visit(spec.components);
  visit(spec.paths);
  return spec;
}

let checkers: { start: ValidateFunction; end: ValidateFunction } | undefined;

/** The spec's own request schemas of `startCall` and `endCall` (from the bundle the app serves),
 * compiled once, with formats checked as the request validator checks them. */
function compile(): { start: ValidateFunction; end: ValidateFunction } {
  if (checkers) return checkers;
  const spec = loadSpec();
  const ajv = new Ajv2020({ strict: false, allErrors: true });
  (addFormats as unknown as (ajv: Ajv2020) => void)(ajv);
  ajv.addSchema({ components: spec.components }, "arbor-spec");
  const at = (name: keyof Schemas) =>
    ajv.compile({ $ref: `arbor-spec#/components/schemas/${String(name)}` });
  checkers = { start: at("CallStartRequest"), end: at("CallEndRequest") };
  return checkers;
}

export type CheckedItem =
  | { mode: "start"; req: Schemas["CallStartRequest"] }
  | { mode: "end"; req: Schemas["CallEndRequest"] };

/** Ajv's errors in the request validator's words: the same `{loc, msg, type}` a 422 has. */
function issuesOf(errors: ErrorObject[], prefix: string): ValidationIssue[] {
  const { error } = toApiError({
    status: 400,
    message: "invalid",
    errors: errors.map((e) => {
      const params = e.params as { missingProperty?: string; additionalProperty?: string };
      const key = params.missingProperty ?? params.additionalProperty;
      return {
        path: `${prefix}${e.instancePath}${key === undefined ? "" : `/${key}`}`,
        message: e.message ?? "is invalid",
        errorCode: `${e.keyword}.openapi.validation`,
      };
    }),
  });
  return error.issues ?? [];
}

/** One batch item checked against the spec: the item, or why it is refused. */
export function checkBatchItem(
  item: unknown,
  index: number,
): { ok: true; item: CheckedItem } | { ok: false; issues: ValidationIssue[] } {
  const loc = ["body", "batch", index];
  if (typeof item !== "object" || item === null || Array.isArray(item)) {
    return {
      ok: false,
      issues: [{ loc, msg: "Input should be a valid dictionary", type: "dict_type" }],
    };
  }
  const { mode, req } = item as { mode?: unknown; req?: unknown };
  if (mode !== "start" && mode !== "end") {
    return {
      ok: false,
      issues: [
        mode === undefined
          ? { loc: [...loc, "mode"], msg: "Field required", type: "missing" }
          : { loc: [...loc, "mode"], msg: "Input should be 'start' or 'end'", type: "enum" },
      ],
    };
  }
  const check = compile()[mode];
  if (!check(req)) {
    return {
      ok: false,
      issues:
        req === undefined
          ? [{ loc: [...loc, "req"], msg: "Field required", type: "missing" }]
          : issuesOf(check.errors ?? [], `/body/batch/${index}/req`),
    };
  }
  return { ok: true, item: { mode, req } as CheckedItem };
}
