import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import type { OperationId } from "./operations.ts";

/** The bundled spec (spec/dist), which the validator, the docs and the router all read. */
export interface OpenApiDocument {
  openapi: string;
  info: { title: string; version: string };
  paths: Record<string, Record<string, { operationId?: string; security?: unknown[] }>>;
  [key: string]: unknown;
}

export const specJsonPath = fileURLToPath(import.meta.resolve("@arbor/spec/openapi.json"));
export const specYamlPath = fileURLToPath(import.meta.resolve("@arbor/spec/openapi.yaml"));

export function loadSpec(): OpenApiDocument {
  return JSON.parse(readFileSync(specJsonPath, "utf8")) as OpenApiDocument;
}

const methods = ["get", "put", "post", "delete", "patch", "head", "options"] as const;
export type HttpMethod = (typeof methods)[number];

export interface SpecOperation {
  operationId: OperationId;
  method: HttpMethod;
  /** The OpenAPI path, e.g. `/v1/preview/models/{model_id}`. */
  path: string;
  /** The same path in Express syntax, e.g. `/v1/preview/models/:model_id`; a literal colon
   * (`/v1/training/runs/{run_id}:close`) is escaped (`/v1/training/runs/:run_id\:close`), since
   * Express's path-to-regexp reads `:` as the start of a parameter. */
  expressPath: string;
  public: boolean;
  /** Path parameters whose schema is an integer: the router hands them over as numbers. */
  integerParams: string[];
}

interface ParameterObject {
  $ref?: string;
  name?: string;
  in?: string;
  schema?: { type?: unknown };
}

/** Every operation of the spec, in document order. */
export function specOperations(spec: OpenApiDocument): SpecOperation[] {
  const out: SpecOperation[] = [];
  for (const [path, item] of Object.entries(spec.paths)) {
    for (const method of methods) {
      const op = item[method];
      if (!op?.operationId) continue;
      out.push({
        operationId: op.operationId as OperationId,
        method,
        path,
        expressPath: path.replace(/:/g, "\\:").replace(/\{([^}]+)\}/g, ":$1"),
        public: Array.isArray(op.security) && op.security.length === 0,
        integerParams: [
          ...((item as { parameters?: ParameterObject[] }).parameters ?? []),
          ...((op as { parameters?: ParameterObject[] }).parameters ?? []),
        ]
          .map((p) => resolveParameter(spec, p))
          .filter((p) => p.in === "path" && p.schema?.type === "integer")
          .map((p) => p.name!),
      });
    }
  }
  return out;
}

function resolveParameter(spec: OpenApiDocument, parameter: ParameterObject): ParameterObject {
  const name = /^#\/components\/parameters\/(.+)$/.exec(parameter.$ref ?? "")?.[1];
  if (!name) return parameter;
  const components = spec.components as { parameters?: Record<string, ParameterObject> };
  return components.parameters?.[name] ?? parameter;
}
