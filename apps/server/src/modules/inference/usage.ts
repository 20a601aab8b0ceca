import type { CallsRepo } from "@arbor/store";
import { uuidv7 } from "@arbor/store";

/** One model call, recorded in the calls store (CONTRACT §6 "Usage is recorded"). */
export interface InferenceCall {
  projectId: string;
  /** The client's trace and parent (headers `Arbor-Trace-Id`, `Arbor-Parent-Call-Id`). */
  traceId: string | undefined;
  parentId: string | undefined;
  startedAt: Date;
  inputs: Record<string, unknown>;
  user: string | undefined;
}

export interface InferenceOutcome {
  /** The model that actually served (the `model` answered), which keys the usage. */
  model: string;
  promptTokens: number;
  completionTokens: number;
  output: unknown;
  exception: string | null;
}

export const CHAT_OP_NAME = "openai.chat.completions.create";

/** Writes the call's start and end in one transaction, with its own usage only. */
export async function recordInferenceCall(
  calls: CallsRepo,
  call: InferenceCall,
  outcome: InferenceOutcome,
): Promise<string> {
  const id = uuidv7();
  const projectId = call.projectId;
  await calls.upsertBatch([
    {
      mode: "start",
      start: {
        project_id: projectId,
        id,
        trace_id: call.traceId ?? id,
        parent_id: call.parentId ?? null,
        op_name: CHAT_OP_NAME,
        display_name: outcome.model,
        started_at: call.startedAt,
        inputs: call.inputs as never,
        attributes: call.user ? { user: call.user } : {},
      },
    },
    {
      mode: "end",
      end: {
        project_id: projectId,
        id,
        ended_at: new Date(),
        output: outcome.output as never,
        exception: outcome.exception,
        summary: {
          usage: {
            [outcome.model]: {
              requests: 1,
              prompt_tokens: outcome.promptTokens,
              completion_tokens: outcome.completionTokens,
              total_tokens: outcome.promptTokens + outcome.completionTokens,
            },
          },
        },
      },
    },
  ]);
  return id;
}
