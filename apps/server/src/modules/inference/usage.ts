import type { CallsRepo } from "@arbor/store";
import { DomainError, UnavailableError, uuidv7 } from "@arbor/store";
import type { Logger } from "pino";

/** One model call: every chat's usage is recorded as a call in the calls store (ADR 27). */
export interface InferenceCall {
  projectId: string;
  /** The client's trace and parent (headers `Arbor-Trace-Id`, `Arbor-Parent-Call-Id`). */
  traceId: string | undefined;
  parentId: string | undefined;
  startedAt: Date;
  inputs: Record<string, unknown>;
  /** What the request says of who asked and why (`user`, `safety_identifier`, `metadata`),
   * kept as the call's attributes. */
  attributes: Record<string, unknown>;
}

export interface InferenceOutcome {
  promptTokens: number;
  completionTokens: number;
  output: unknown;
  exception: string | null;
}

export const CHAT_OP_NAME = "openai.chat.completions.create";

/** The largest `inputs` or `output` kept with a call, as JSON; a larger one is kept as a note
 * of what it held, so the call and its usage are still recorded. */
export const MAX_RECORDED_JSON_BYTES = 1024 * 1024;

/** How the end of a call is retried when the store fails: delays in ms. */
const END_RETRIES_MS = [100, 500, 2000];

/**
 * The call a chat request is recorded as. Its start is written before anything is generated, so
 * a request whose call cannot be stored is refused (503) without being served; its end, with
 * the tokens actually produced, is written once generation stops, whatever way it stops.
 */
export class RecordedCall {
  readonly id: string;
  readonly #calls: CallsRepo;
  readonly #projectId: string;
  readonly #model: string;
  readonly #logger: Logger;

  private constructor(
    calls: CallsRepo,
    projectId: string,
    id: string,
    model: string,
    logger: Logger,
  ) {
    this.#calls = calls;
    this.#projectId = projectId;
    this.id = id;
    this.#model = model;
    this.#logger = logger;
  }

  /** Writes the start; a store failure is a 503 before generation. `model` is the id that
   * serves (the `model` answered), which keys the usage. */
  static async open(
    calls: CallsRepo,
    call: InferenceCall,
    model: string,
    logger: Logger,
  ): Promise<RecordedCall> {
    const id = uuidv7();
    try {
      await calls.startCall({
        project_id: call.projectId,
        id,
        trace_id: call.traceId ?? id,
        parent_id: call.parentId ?? null,
        op_name: CHAT_OP_NAME,
        display_name: model,
        started_at: call.startedAt,
        inputs: recordable(call.inputs),
        attributes: call.attributes,
      });
    } catch (err) {
      if (err instanceof DomainError) throw err;
      logger.error({ err }, "could not record the start of an inference call");
      throw new UnavailableError(
        "Service unavailable: usage cannot be recorded right now, so the request was not served.",
        { retryAfterSeconds: 5 },
      );
    }
    return new RecordedCall(calls, call.projectId, id, model, logger);
  }

  /** Writes the end with the call's own usage; retried when the store fails, never thrown. */
  async close(outcome: InferenceOutcome): Promise<void> {
    const end = {
      project_id: this.#projectId,
      id: this.id,
      ended_at: new Date(),
      output: recordable(outcome.output),
      exception: outcome.exception,
      summary: {
        usage: {
          [this.#model]: {
            requests: 1,
            prompt_tokens: outcome.promptTokens,
            completion_tokens: outcome.completionTokens,
            total_tokens: outcome.promptTokens + outcome.completionTokens,
          },
        },
      },
    };
    for (let attempt = 0; ; attempt++) {
      try {
        await this.#calls.endCall(end);
        return;
      } catch (err) {
        const wait = END_RETRIES_MS[attempt];
        if (wait === undefined) {
          this.#logger.error(
            { err, callId: this.id },
            "could not record the end of an inference call: it stays unfinished, without usage",
          );
          return;
        }
        await new Promise((resolve) => setTimeout(resolve, wait));
      }
    }
  }
}

/** `value` when its JSON fits `MAX_RECORDED_JSON_BYTES`, else a note of what was left out. */
export function recordable(value: unknown): unknown {
  const json = JSON.stringify(value ?? null);
  const bytes = Buffer.byteLength(json, "utf8");
  if (bytes <= MAX_RECORDED_JSON_BYTES) return value ?? null;
  return { _arbor_omitted: { reason: "larger than the recording limit", bytes } };
}
