import type { components } from "@arbor/spec/schema";
import type { ChatRequest } from "./chat.ts";
import type { ResolvedModel } from "./models.ts";
import { postUpstream, sanitizeChunk, sanitizeCompletion, upstreamChunks } from "./upstream.ts";
import type { RecordedCall } from "./usage.ts";

type Schemas = components["schemas"];
type ChatCompletion = Schemas["ChatCompletion"];
type ChatCompletionChunk = Schemas["ChatCompletionChunk"];

/** Forwards a chat request to the model's upstream, streamed or not, and records its usage like
 * any other inference call. `onChunk` receives our chunks when streaming. */
export async function runUpstreamChat(
  resolved: ResolvedModel,
  body: ChatRequest,
  call: RecordedCall,
  signal: AbortSignal,
  onChunk?: (chunk: ChatCompletionChunk) => void,
): Promise<ChatCompletion | undefined> {
  const upstream = resolved.upstream!;
  const outgoing = { ...body, model: upstream.model ?? resolved.id } as Record<string, unknown>;
  let promptTokens = 0;
  let completionTokens = 0;
  let output: unknown = null;
  let failure: unknown;
  try {
    if (!onChunk) {
      const response = await postUpstream(upstream, { ...outgoing, stream: false }, signal);
      const completion = sanitizeCompletion((await response.json()) as ChatCompletion, resolved.id);
      promptTokens = completion.usage.prompt_tokens;
      completionTokens = completion.usage.completion_tokens;
      output = completion;
      return completion;
    }
    // Usage is always asked upstream, so it can be recorded; the client gets it only if it asked.
    const wantsUsage = body.stream_options?.include_usage === true;
    const response = await postUpstream(
      upstream,
      { ...outgoing, stream: true, stream_options: { include_usage: true } },
      signal,
    );
    for await (const raw of upstreamChunks(response)) {
      const chunk = sanitizeChunk(raw, resolved.id);
      if (chunk.usage) {
        promptTokens = chunk.usage.prompt_tokens;
        completionTokens = chunk.usage.completion_tokens;
      }
      if (chunk.choices.length > 0 || wantsUsage) {
        const { usage, ...rest } = chunk;
        onChunk(wantsUsage && usage ? chunk : rest);
      }
    }
  } catch (err) {
    failure = err;
    throw err;
  } finally {
    const exception =
      failure === undefined
        ? null
        : signal.aborted
          ? "cancelled: the client disconnected"
          : String((failure as Error).message ?? failure);
    await call.close({ promptTokens, completionTokens, output, exception });
  }
}
