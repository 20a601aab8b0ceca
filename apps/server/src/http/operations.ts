import type { operations } from "@arbor/spec/schema";
import type { Request, Response } from "express";
import type { Principal } from "./principal.ts";

/** The join key everywhere: handler name, client method, contract test `describe`. */
export type OperationId = keyof operations;

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

export interface HandlerInput<K extends OperationId> {
  body: RequestBody<K>;
  params: PathParams<K>;
  query: QueryParams<K>;
  /** The authenticated key's principal; null only on public operations. */
  principal: Principal | null;
  req: Request;
  res: Response;
}

export type Handler<K extends OperationId> = (
  input: HandlerInput<K>,
) => Promise<SuccessBody<K> | typeof RESPONDED> | SuccessBody<K> | typeof RESPONDED;

/** What a module contributes: handlers keyed by operationId. Missing ones answer 501. */
export type Handlers = { [K in OperationId]?: Handler<K> };
