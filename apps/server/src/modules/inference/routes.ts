import type { Request, Response } from "express";
import { type HandlerInput, type Handlers, RESPONDED } from "../../http/operations.ts";
import { disconnectSignal, streamSse } from "../../http/sse.ts";
import type { ProjectRef } from "../access.ts";
import type { ChatRequest } from "./chat.ts";
import type { ModelDirectory } from "./models.ts";
import {
  chatRequestOf,
  type ResponseRequest,
  type ResponseStreamEvent,
  responseEvents,
  responseOf,
} from "./responses.ts";
import type { ChatService } from "./service.ts";
import type { InferenceCall } from "./usage.ts";

type ChatInput = Pick<HandlerInput<"createChatCompletion">, "principal" | "project"> & {
  body: ChatRequest;
  req: Request;
  res: Response;
};

export interface InferenceDeps {
  chat: ChatService;
  directory: ModelDirectory;
}

/** The inference surface: chat completions (both paths) and the model listing. */
export function inferenceHandlers(deps: InferenceDeps): Handlers {
  // Both chat paths (with and without the trailing slash) take the same request.
  const chat = async ({ body, principal, project, req, res }: ChatInput) => {
    // Listened for before anything is awaited: a client that leaves while the chat is being
    // prepared must still stop it.
    const signal = disconnectSignal(res);
    const run = await deps.chat.start(principal, body, callOf(req, project, body));
    if (!body.stream) return run.complete(signal);
    await streamSse(res, run.chunks(signal));
    return RESPONDED;
  };
  return {
    createChatCompletion: chat,
    createChatCompletionTrailingSlash: chat,
    // The Responses API: the same chat, asked and answered in its shapes (ADR 65).
    createResponse: async ({ body, principal, project, req, res }) => {
      const signal = disconnectSignal(res);
      const request = body as ResponseRequest;
      const chatBody = chatRequestOf(request);
      const run = await deps.chat.start(principal, chatBody, callOf(req, project, chatBody));
      if (!request.stream) return responseOf(request, await run.complete(signal));
      await streamSse(res, responseEvents(request, run, run.chunks(signal)), {
        done: false,
        eventName: (event) => (event as ResponseStreamEvent).type,
      });
      return RESPONDED;
    },
    listModels: async ({ principal, query }) => ({
      object: "list",
      data: await deps.directory.list(principal, { checkpoints: query.include === "checkpoints" }),
    }),
    retrieveModel: ({ principal, params }) => deps.directory.retrieve(principal, params.model),
  };
}

/** The call this request is recorded as: under the project header's project, nested in the
 * client's trace when it sent `Arbor-Trace-Id` / `Arbor-Parent-Call-Id`. */
function callOf(req: Request, project: ProjectRef, body: ChatRequest): InferenceCall {
  return {
    projectId: project.id,
    traceId: req.header("arbor-trace-id") || undefined,
    parentId: req.header("arbor-parent-call-id") || undefined,
    startedAt: new Date(),
    inputs: { ...body },
    attributes: Object.fromEntries(
      (["user", "safety_identifier", "metadata"] as const)
        .filter((key) => body[key] !== null && body[key] !== undefined)
        .map((key) => [key, body[key]]),
    ),
  };
}
