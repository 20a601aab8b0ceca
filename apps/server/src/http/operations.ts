import type { operations } from "@arbor/spec/schema";
import type { Request, Response } from "express";
import type { Principal, ProjectRef } from "../modules/access.ts";

/** The join key everywhere: handler name, client method, contract test `describe`. */
export type OperationId = keyof operations;

/** The operations the spec marks `security: []`; a test checks this list against the spec. */
export const PUBLIC_OPERATIONS = ["getHealth", "getSystemCheck"] as const satisfies OperationId[];
export type PublicOperationId = (typeof PUBLIC_OPERATIONS)[number];
export type AuthenticatedOperationId = Exclude<OperationId, PublicOperationId>;

type Op<K extends OperationId> = operations[K];

type JsonOf<T> = T extends { content: { "application/json": infer B } } ? B : undefined;

export type RequestBody<K extends OperationId> =
  Op<K> extends { requestBody?: infer R } ? JsonOf<NonNullable<R>> : undefined;

export type PathParams<K extends OperationId> = Op<K>["parameters"] extends { path?: infer P }
  ? NonNullable<P>
  : Record<string, never>;

export type QueryParams<K extends OperationId> = Op<K>["parameters"] extends { query?: infer Q }
  ? NonNullable<Q>
  : Record<string, never>;

export type SuccessBody<K extends OperationId> = Op<K>["responses"] extends { 200: infer R }
  ? JsonOf<R>
  : never;

/** Returned by a handler that wrote the response itself (SSE streams, non-JSON bodies). */
export const RESPONDED: unique symbol = Symbol("responded");

/** What every handler gets: the request as the validator passed it. */
export interface PublicInput<K extends OperationId> {
  body: RequestBody<K>;
  params: PathParams<K>;
  query: QueryParams<K>;
  req: Request;
  res: Response;
}

/** What an authenticated operation's handler gets besides: who calls, and for which project
 * (the project header's, or the key's default). */
export interface HandlerInput<K extends OperationId> extends PublicInput<K> {
  principal: Principal;
  project: ProjectRef;
}

type Result<K extends OperationId> =
  | Promise<SuccessBody<K> | typeof RESPONDED>
  | SuccessBody<K>
  | typeof RESPONDED;

export type Handler<K extends OperationId> = (input: HandlerInput<K>) => Result<K>;
export type PublicHandler<K extends OperationId> = (input: PublicInput<K>) => Result<K>;

/** What a module contributes: handlers keyed by operationId. Missing ones answer 501. */
export type Handlers = { [K in AuthenticatedOperationId]?: Handler<K> } & {
  [K in PublicOperationId]?: PublicHandler<K>;
};
