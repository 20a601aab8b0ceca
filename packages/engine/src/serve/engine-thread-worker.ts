/**
 * An engine thread (see `EngineThread`): loads one model, then renders prompts and runs
 * generations for the thread that started it. Events of one scheduler step go back together,
 * in one message per generation.
 */
import { parentPort, workerData } from "node:worker_threads";
import { adapterFromFiles, type LoraAdapter } from "../model/lora.ts";
import { loadServingModel, parameterCount, type WeightChoice } from "../model/model.ts";
import { toolCallFormat } from "../model/tool-calls.ts";
import { Engine, type GenerationEvent } from "./engine.ts";
import type { FromEngineThread, ToEngineThread } from "./engine-thread.ts";
import { ContextLengthError } from "./prompt-encoder.ts";

const { modelDir, threads, weights } = workerData as {
  modelDir: string;
  threads: number;
  weights: WeightChoice;
};
const post = (message: FromEngineThread, transfer: ArrayBuffer[] = []) =>
  parentPort!.postMessage(message, transfer);

let engine: Engine;
try {
  // The weights live packed in the kernels' arena, their only copy.
  const { kernels, model } = await loadServingModel(modelDir, { threads, weights });
  engine = new Engine(model, { kernels });
  post({
    type: "ready",
    info: {
      config: model.config,
      maxTokenBytes: model.tokenizer.maxTokenBytes(),
      parameters: parameterCount(model),
      toolCallFormat: toolCallFormat(model.chat.template.source),
    },
  });
} catch (err) {
  post({ type: "failed", message: err instanceof Error ? err.message : String(err) });
  process.exit(1);
}

const adapters = new Map<string, LoraAdapter>();
const running = new Map<number, AbortController>();

function fail(id: number, err: unknown): void {
  const error = err instanceof Error ? err : new Error(String(err));
  post({
    type: "error",
    id,
    name: error.name,
    message: error.message,
    ...(error instanceof ContextLengthError
      ? { tokens: error.tokens, context: error.context }
      : {}),
  });
}

async function generate(
  id: number,
  request: Extract<ToEngineThread, { type: "generate" }>["request"],
) {
  const controller = new AbortController();
  running.set(id, controller);
  let batch: GenerationEvent[] = [];
  let flushing = false;
  // Events produced in one scheduler step go out together, after the step.
  const flush = () => {
    flushing = false;
    if (batch.length === 0) return;
    post({ type: "events", id, events: batch });
    batch = [];
  };
  try {
    const adapter = request.adapter ? adapters.get(request.adapter) : null;
    if (request.adapter && !adapter) throw new Error(`adapter ${request.adapter} is not loaded`);
    for await (const event of engine.generate(
      { ...request, adapter: adapter ?? null },
      { signal: controller.signal },
    )) {
      batch.push(event);
      if (!flushing) {
        flushing = true;
        setImmediate(flush);
      }
    }
    flush();
    post({ type: "end", id });
  } catch (err) {
    flush();
    if (!controller.signal.aborted) fail(id, err);
  } finally {
    running.delete(id);
  }
}

parentPort!.on("message", (message: ToEngineThread) => {
  switch (message.type) {
    case "encode":
      engine.encodeChat(message.messages, message.options).then(
        (tokens) => {
          const ids = Int32Array.from(tokens);
          post({ type: "encoded", id: message.id, tokens: ids }, [ids.buffer]);
        },
        (err: unknown) => fail(message.id, err),
      );
      return;
    case "generate":
      void generate(message.id, message.request);
      return;
    case "prompt-logprobs":
      try {
        const adapter = message.adapter ? adapters.get(message.adapter) : null;
        if (message.adapter && !adapter)
          throw new Error(`adapter ${message.adapter} is not loaded`);
        const logprobs = engine.promptLogprobs(message.tokens, adapter ?? null);
        post({ type: "prompt-logprobs", id: message.id, logprobs }, [
          logprobs.buffer as ArrayBuffer,
        ]);
      } catch (err) {
        fail(message.id, err);
      }
      return;
    case "cancel":
      running.get(message.id)?.abort(new Error("cancelled"));
      return;
    case "adapter":
      try {
        adapters.set(message.key, adapterFromFiles(message.files, engine.model));
        post({ type: "done", id: message.id });
      } catch (err) {
        fail(message.id, err);
      }
      return;
    case "drop-adapter":
      adapters.delete(message.key);
      return;
    case "stats":
      post({
        type: "done",
        id: message.id,
        stats: { ...engine.stats, activeSequences: engine.activeSequences },
      });
      return;
  }
});
