import { randomUUID } from "node:crypto";
import {
  catalogModelDir,
  HEAD_TARGET,
  LORA_TARGETS,
  loadModel,
  type Model,
} from "@arbor/engine/model";
import { afterAll, beforeAll, expect } from "vitest";
import { type RunningServer, startServer } from "../harness.ts";
import { reversal } from "../jobs.ts";
import type { STORES } from "../pg.ts";
import { adam, HttpError, RunClient, TrainingRuns, wireLoss } from "./client.ts";
import { type SftTokens, type TokenizedRollout, tokenMatrixBatchFromSft } from "./token-matrix.ts";
import type {
  ForwardBackwardResult,
  OptimStepResult,
  TokenMatrixBatch,
  WireRunSpec,
} from "./wire.ts";

/** What the native-runs contract tests train: the shipped tiny model, as ART would ask for it. */
export const BASE = "arbor/tiny-chat";

/** A rank-4 adapter on the seven linears and the head (ADR 51), targets sorted as ART sends them,
 * and no seed. */
export const SPEC: WireRunSpec = {
  base_model: BASE,
  dtype: "bfloat16",
  lora_rank: 4,
  lora_target_modules: [...LORA_TARGETS, HEAD_TARGET].sort(),
  seed: null,
};

/** ART's SFT loss: cross-entropy, advantages not normalised. */
export const CROSS_ENTROPY = wireLoss("cross_entropy", { normalizeAdvantages: false });

let tiny: Promise<Model> | undefined;
/** The base model's own files: its tokenizer, chat template and vocabulary size. */
export function tinyModel(): Promise<Model> {
  tiny ??= loadModel(catalogModelDir(BASE));
  return tiny;
}

/** A request id as ART makes them: a prefix and 32 hex digits. */
export function requestId(prefix: string): string {
  return `${prefix}-${randomUUID().replaceAll("-", "")}`;
}

/** One reversal example tokenized for SFT, labels only on the assistant's reply (the word
 * reversed, or `answer`). */
export async function sftTokens(word: string, answer?: string): Promise<SftTokens> {
  const { chat } = await tinyModel();
  const { messages: example } = reversal(word);
  const messages =
    answer === undefined ? example : [example[0]!, { role: "assistant" as const, content: answer }];
  const { tokens, mask } = chat.trainingTokens(messages, () => true);
  return { inputIds: tokens, labels: tokens.map((id, i) => (mask[i] ? id : -100)) };
}

/** The SFT batch of some reversal examples, as ART lowers it. */
export async function reversalBatch(words: readonly string[]): Promise<TokenMatrixBatch> {
  const batch = tokenMatrixBatchFromSft(await Promise.all(words.map((word) => sftTokens(word))));
  if (!batch) throw new Error("no trainable token");
  return batch;
}

/** A rollout of one reversal prompt: the prompt, then the reply the assistant sampled (the word
 * reversed, or `answer`), each reply token with the sampler's `logprob`. */
export async function rollout(
  word: string,
  fields: Omit<TokenizedRollout, "tokenIds" | "assistantMask" | "logprobs"> & {
    logprob: (position: number) => number;
    answer?: string;
  },
): Promise<TokenizedRollout> {
  const { inputIds, labels } = await sftTokens(word, fields.answer);
  const assistantMask = labels.map((l) => (l === -100 ? 0 : 1));
  return {
    tokenIds: inputIds,
    assistantMask,
    logprobs: inputIds.map((_, p) => (assistantMask[p] ? fields.logprob(p) : Number.NaN)),
    advantage: fields.advantage,
    weight: fields.weight,
    promptId: fields.promptId,
    policyVersions: fields.policyVersions ?? null,
  };
}

/** One SFT step as ART's backend takes it: forward_backward, then optim_step. */
export async function sftStep(
  run: RunClient,
  batch: TokenMatrixBatch,
  learningRate = 1e-2,
): Promise<{ forward: ForwardBackwardResult; optimizer: OptimStepResult }> {
  const id = randomUUID().replaceAll("-", "");
  const fb = await run.forwardBackward({
    requestId: `fb-${id}`,
    batch,
    loss: CROSS_ENTROPY,
    returnTokenLogprobs: false,
  });
  const forward = await fb.result();
  const optim = await run.optimStep(`optim-${id}`, adam(learningRate));
  return { forward, optimizer: await optim.result() };
}

/** Expects `promise` to be refused with `status` and error `code`; answers the error. */
export async function refused(
  promise: Promise<unknown>,
  status: number,
  code: string,
): Promise<HttpError> {
  const error = await promise.then(
    (value) => {
      throw new Error(`expected ${status} ${code}, got ${JSON.stringify(value).slice(0, 300)}`);
    },
    (err: unknown) => err,
  );
  expect(error, String(error)).toBeInstanceOf(HttpError);
  const http = error as HttpError;
  expect({ status: http.status, code: http.code }, http.message).toEqual({ status, code });
  return http;
}

/**
 * A server with its embedded worker on one of `STORES`, started before the enclosing describe's
 * tests and closed after them, with the admin's ART-style client.
 */
export function nativeServer({ postgres, skip }: (typeof STORES)[number]) {
  const started: { server?: RunningServer; runs?: TrainingRuns } = {};
  beforeAll(async () => {
    if (skip !== null) return;
    started.server = await startServer({}, { worker: true, ...(postgres ? { postgres } : {}) });
    started.runs = new TrainingRuns(started.server.baseUrl, started.server.adminKey);
  });
  afterAll(async () => {
    await started.server?.close();
  });
  return {
    server: () => started.server!,
    runs: () => started.runs!,
    /** A new open run of `SPEC`. */
    openRun: () =>
      RunClient.resolve(started.runs!, { requestId: requestId("resolve"), spec: SPEC }),
  };
}
