import type { Request, Response } from "express";
import type { ProjectRef } from "../../http/auth.ts";
import { ApiError, envelope } from "../../http/errors.ts";
import { type Handler, type Handlers, RESPONDED } from "../../http/operations.ts";
import { disconnectSignal, SseWriter } from "../../http/sse.ts";
import { type ChatRequest, toLogprobs } from "./chat.ts";
import {
  type ChatCompletion,
  type ChatCompletionChunk,
  type InferenceDeps,
  prepareChat,
  runChat,
} from "./service.ts";
import { runUpstreamChat } from "./upstream-chat.ts";
import { type InferenceCall, RecordedCall } from "./usage.ts";

/** The inference surface: chat completions (both paths) and the model listing. */
export function inferenceHandlers(deps: InferenceDeps): Handlers {
  const chat: Handler<"createChatCompletion"> = async ({ body, principal, req, res }) => {
    const resolved = await deps.directory.resolve(principal!, body.model);
    const signal = disconnectSignal(res);
    if (resolved.upstream) {
      const call = await RecordedCall.open(
        deps.calls,
        callOf(req, res, body),
        resolved.id,
        deps.logger,
      );
      if (!body.stream)
        return (await runUpstreamChat(resolved, body, call, signal)) as ChatCompletion;
      // The upstream's refusal (before its stream started) is still a plain error response.
      let sse: SseWriter | undefined;
      await streamed(
        res,
        deps,
        () => sse,
        async () => {
          await runUpstreamChat(resolved, body, call, signal, (chunk) => {
            sse ??= new SseWriter(res);
            sse.send(chunk);
          });
          sse ??= new SseWriter(res);
        },
      );
      return RESPONDED;
    }
    const prepared = await prepareChat(deps, resolved, body);
    // Recorded from here on: a request whose call cannot be stored is refused, not served.
    const call = await RecordedCall.open(
      deps.calls,
      callOf(req, res, body),
      resolved.id,
      deps.logger,
    );
    if (!body.stream) return runChat(prepared, call, signal);

    const sse = new SseWriter(res);
    const chunk = (
      choices: ChatCompletionChunk["choices"],
      usage?: ChatCompletionChunk["usage"],
    ): ChatCompletionChunk => ({
      id: prepared.id,
      object: "chat.completion.chunk",
      created: prepared.created,
      model: prepared.resolved.id,
      system_fingerprint: prepared.fingerprint,
      choices,
      ...(usage ? { usage } : {}),
    });
    for (let index = 0; index < (prepared.request.n ?? 1); index++) {
      sse.send(chunk([{ index, delta: { role: "assistant", content: "" }, finish_reason: null }]));
    }
    await streamed(
      res,
      deps,
      () => sse,
      async () => {
        const completion = await runChat(prepared, call, signal, (progress) => {
          if (progress.type === "delta") {
            sse.send(
              chunk([
                {
                  index: progress.choice,
                  delta: { content: progress.content },
                  finish_reason: null,
                  ...(progress.logprob ? { logprobs: toLogprobs([progress.logprob]) } : {}),
                },
              ]),
            );
          } else {
            const delta = progress.content ? { content: progress.content } : {};
            sse.send(
              chunk([{ index: progress.choice, delta, finish_reason: progress.finishReason }]),
            );
          }
        });
        if (body.stream_options?.include_usage) sse.send(chunk([], completion.usage));
      },
    );
    return RESPONDED;
  };

  return {
    createChatCompletion: chat,
    createChatCompletionTrailingSlash: chat as never,
    listModels: async ({ principal }) => ({
      object: "list",
      data: await deps.directory.list(principal!),
    }),
    retrieveModel: ({ principal, params }) => deps.directory.retrieve(principal!, params.model),
  };
}

/** Runs a stream: `[DONE]` after a clean end; an error after the headers went out becomes an
 * SSE error event; an error before them (no writer yet) is an ordinary error response. */
async function streamed(
  res: Response,
  deps: InferenceDeps,
  writer: () => SseWriter | undefined,
  run: () => Promise<void>,
): Promise<void> {
  try {
    await run();
    writer()?.send("[DONE]");
  } catch (err) {
    const sse = writer();
    if (!sse) throw err;
    if (sse.open) {
      const error = err instanceof ApiError ? err : new ApiError(500, "Internal server error.");
      if (!(err instanceof ApiError))
        deps.logger.error({ err, requestId: res.locals.requestId }, "stream failed");
      sse.send(envelope("v1", error, res.locals.requestId as string).body);
    }
  } finally {
    writer()?.end();
  }
}

/** The call this request is recorded as: under the project header's project, nested in the
 * client's trace when it sent `Arbor-Trace-Id` / `Arbor-Parent-Call-Id`. */
function callOf(req: Request, res: Response, body: ChatRequest): InferenceCall {
  const project = res.locals.project as ProjectRef;
  return {
    projectId: project.id,
    traceId: req.header("arbor-trace-id") || undefined,
    parentId: req.header("arbor-parent-call-id") || undefined,
    startedAt: new Date(),
    inputs: { ...body },
    user: body.user ?? undefined,
  };
}
