import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import type { components } from "@arbor/spec/schema";
import { Ajv2020, type ErrorObject, type ValidateFunction } from "ajv/dist/2020.js";

export type { ErrorObject };

type SchemaName = keyof components["schemas"];

let ajv: Ajv2020 | undefined;

/** Ajv over the bundled spec's schemas (OpenAPI 3.1 schemas are JSON Schema 2020-12), read once
 * per process. `verbose` keeps each error's schema node, for its `x-error-message`. */
function specAjv(): Ajv2020 {
  if (ajv) return ajv;
  const path = fileURLToPath(import.meta.resolve("@arbor/spec/openapi.json"));
  const spec = JSON.parse(readFileSync(path, "utf8")) as { components: unknown };
  ajv = new Ajv2020({ strict: false, verbose: true, allErrors: false });
  ajv.addSchema({ components: spec.components }, "arbor-spec");
  return ajv;
}

/** A check of one of the spec's schemas; after a failure, `errors` says why. */
export interface Validator<T> {
  (data: unknown): data is T;
  errors: ErrorObject[] | null | undefined;
}

/** A validator for one of the spec's schemas, compiled on first use. */
export function validator<T>(name: SchemaName): Validator<T> {
  let compiled: ValidateFunction<T> | undefined;
  const validate: Validator<T> = Object.assign(
    (data: unknown): data is T => {
      compiled ??= specAjv().compile<T>({ $ref: `arbor-spec#/components/schemas/${name}` });
      const ok = compiled(data);
      validate.errors = compiled.errors;
      return ok;
    },
    { errors: undefined },
  );
  return validate;
}
