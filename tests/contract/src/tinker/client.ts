import { fileURLToPath } from "node:url";
import protobuf from "protobufjs";

/**
 * A Tinker client of our own (ADR 71), speaking the wire as the `tinker` SDK 0.25 does
 * (docs/tinker.md): `X-API-Key: tml-<key>`, JSON requests but forward_backward's, which is a
 * protobuf `ForwardBackwardRequest`; futures polled through `retrieve_future` (again on
 * `try_again`), protobuf results for forward_backward and sample, `{error, category}` for a
 * failure. Its messages are read by reflection from the repository's schema,
 * `spec/tinker/tinker_public.proto`, not from the server's code.
 */
const root = protobuf.loadSync(
  fileURLToPath(import.meta.resolve("@arbor/spec/tinker/tinker_public.proto")),
);
const ForwardBackwardRequest = root.lookupType("tinker_public.ForwardBackwardRequest");
const ForwardBackwardOutput = root.lookupType("tinker_public.ForwardBackwardOutput");
const SampleResponse = root.lookupType("tinker_public.SampleResponse");

const DTYPE_FLOAT32 = 1;
const DTYPE_INT64 = 2;

/** One datum as the SDK builds it: `model_input` tokens and per-position inputs. */
export interface Datum {
  tokens: number[];
  targetTokens: number[];
  weights?: number[];
  logprobs?: number[];
  advantages?: number[];
}

export class HttpError extends Error {
  readonly status: number;
  readonly body: unknown;
  constructor(status: number, body: unknown) {
    super(`HTTP ${status}: ${JSON.stringify(body)}`);
    this.status = status;
    this.body = body;
  }
}

/** A future that failed on the server (`{error, category}`), as the SDK's RequestFailedError. */
export class RequestFailed extends Error {
  readonly category: string;
  constructor(error: string, category: string) {
    super(error);
    this.category = category;
  }
}

export interface ForwardBackwardResult {
  logprobs: Float32Array[];
  metrics: Record<string, number>;
}

export interface SampledSequence {
  stopReason: "stop" | "length";
  tokens: number[];
  logprobs: number[];
}

export interface SampleResult {
  sequences: SampledSequence[];
  promptLogprobs: (number | null)[] | null;
}

const int32Bytes = (values: readonly number[]) => new Uint8Array(Int32Array.from(values).buffer);
const int64Bytes = (values: readonly number[]) =>
  new Uint8Array(BigInt64Array.from(values.map(BigInt)).buffer);
const float32Bytes = (values: readonly number[]) =>
  new Uint8Array(Float32Array.from(values).buffer);
const floats = (bytes: Uint8Array) => {
  const copy = new Uint8Array(bytes);
  return new Float32Array(copy.buffer);
};
const ints = (bytes: Uint8Array) => [...new Int32Array(new Uint8Array(bytes).buffer)];

export class TinkerClient {
  readonly #base: string;
  readonly #key: string;
  /** How many `try_again` answers futures got (the long-poll let them wait on the server). */
  tryAgains = 0;

  /** `baseUrl` is the server's root; the client appends `/tinker/api/v1` as the SDK keeps the
   * path of `TINKER_BASE_URL=<root>/tinker`. */
  constructor(baseUrl: string, apiKey: string) {
    this.#base = `${baseUrl}/tinker/api/v1`;
    this.#key = apiKey.startsWith("tml-") ? apiKey : `tml-${apiKey}`;
  }

  async #send(
    method: string,
    path: string,
    body?: unknown,
    headers: Record<string, string> = {},
  ): Promise<Response> {
    const init: RequestInit = {
      method,
      headers: { "x-api-key": this.#key, ...headers },
    };
    if (body instanceof Uint8Array) {
      init.body = body;
      (init.headers as Record<string, string>)["content-type"] = "application/x-protobuf";
    } else if (body !== undefined) {
      init.body = JSON.stringify(body);
      (init.headers as Record<string, string>)["content-type"] = "application/json";
    }
    const res = await fetch(`${this.#base}/${path}`, init);
    if (!res.ok) {
      const text = await res.text();
      let parsed: unknown = text;
      try {
        parsed = JSON.parse(text);
      } catch {}
      throw new HttpError(res.status, parsed);
    }
    return res;
  }

  async json<T = Record<string, unknown>>(method: string, path: string, body?: unknown) {
    return (await (await this.#send(method, path, body)).json()) as T;
  }

  /** Polls a future until it ends: JSON, or the raw protobuf bytes when `protobuf`. */
  async #retrieve(requestId: string, protobuf: boolean): Promise<unknown> {
    for (;;) {
      const res = await this.#send(
        "POST",
        "retrieve_future",
        { request_id: requestId, allow_metadata_only: false },
        protobuf ? { accept: "application/x-protobuf, application/json" } : {},
      );
      if ((res.headers.get("content-type") ?? "").startsWith("application/x-protobuf"))
        return new Uint8Array(await res.arrayBuffer());
      const body = (await res.json()) as Record<string, unknown>;
      if (body.type === "try_again") {
        this.tryAgains++;
        continue;
      }
      if (typeof body.error === "string")
        throw new RequestFailed(body.error, String(body.category));
      if (protobuf)
        throw new Error(`a JSON answer where protobuf was asked: ${JSON.stringify(body)}`);
      return body;
    }
  }

  async result<T = Record<string, unknown>>(future: { request_id: string }): Promise<T> {
    return (await this.#retrieve(future.request_id, false)) as T;
  }

  createSession(): Promise<{ session_id: string }> {
    return this.json("POST", "create_session", {
      tags: [],
      user_metadata: {},
      sdk_version: "0.25.0",
      type: "create_session",
    });
  }

  /** `create_model` and its future: the model id. */
  async createModel(
    sessionId: string,
    modelSeqId: number,
    baseModel: string,
    rank: number,
    seed?: number,
  ): Promise<string> {
    const future = await this.json<{ request_id: string }>("POST", "create_model", {
      session_id: sessionId,
      model_seq_id: modelSeqId,
      base_model: baseModel,
      lora_config: { rank, seed, train_unembed: true, train_mlp: true, train_attn: true },
      type: "create_model",
    });
    return (await this.result<{ model_id: string }>(future)).model_id;
  }

  /** `forward_backward` (or `forward` with `forwardOnly`) as a protobuf body; its future. */
  submitForwardBackward(
    modelId: string,
    seqId: number,
    data: readonly Datum[],
    lossFn: string,
    options: { config?: Record<string, number>; forwardOnly?: boolean } = {},
  ): Promise<{ request_id: string }> {
    const tensor = (values: readonly number[], dtype: number) => ({
      dense: dtype === DTYPE_INT64 ? int64Bytes(values) : float32Bytes(values),
      dtype,
      shape: [values.length],
    });
    const message = ForwardBackwardRequest.fromObject({
      modelId,
      seqId,
      lossFn,
      lossFnConfig: options.config ?? {},
      forwardOnly: options.forwardOnly ?? false,
      data: data.map((d) => ({
        modelInput: [{ encodedText: { tokens: int32Bytes(d.tokens) } }],
        lossFnInputs: {
          target_tokens: tensor(d.targetTokens, DTYPE_INT64),
          ...(d.weights ? { weights: tensor(d.weights, DTYPE_FLOAT32) } : {}),
          ...(d.logprobs ? { logprobs: tensor(d.logprobs, DTYPE_FLOAT32) } : {}),
          ...(d.advantages ? { advantages: tensor(d.advantages, DTYPE_FLOAT32) } : {}),
        },
      })),
    });
    return this.json("POST", "forward_backward", ForwardBackwardRequest.encode(message).finish());
  }

  /** A forward_backward future's result, decoded as the SDK does (`ArrayRecord` byte offsets). */
  async forwardBackwardResult(future: { request_id: string }): Promise<ForwardBackwardResult> {
    const bytes = (await this.#retrieve(future.request_id, true)) as Uint8Array;
    const out = ForwardBackwardOutput.toObject(ForwardBackwardOutput.decode(bytes), {
      longs: Number,
      arrays: true,
      objects: true,
    }) as {
      lossFnOutputs: {
        numDatums: number;
        fields: Record<string, { data: Uint8Array; offsets: Uint8Array }>;
      }[];
      metrics: Record<string, number>;
    };
    const logprobs: Float32Array[] = [];
    for (const record of out.lossFnOutputs) {
      const field = record.fields.logprobs!;
      const offsets = new BigInt64Array(new Uint8Array(field.offsets).buffer);
      for (let i = 0; i < record.numDatums; i++)
        logprobs.push(floats(field.data.subarray(Number(offsets[i]!), Number(offsets[i + 1]!))));
    }
    return { logprobs, metrics: out.metrics };
  }

  async forwardBackward(
    modelId: string,
    seqId: number,
    data: readonly Datum[],
    lossFn: string,
    options: { config?: Record<string, number>; forwardOnly?: boolean } = {},
  ): Promise<ForwardBackwardResult> {
    return this.forwardBackwardResult(
      await this.submitForwardBackward(modelId, seqId, data, lossFn, options),
    );
  }

  async optimStep(
    modelId: string,
    seqId: number,
    adam: Record<string, number>,
  ): Promise<Record<string, unknown>> {
    const future = await this.json<{ request_id: string }>("POST", "optim_step", {
      adam_params: adam,
      model_id: modelId,
      seq_id: seqId,
      type: "optim_step",
    });
    return this.result(future);
  }

  /** A sample future's result, decoded as the SDK does. */
  async sampleResult(future: { request_id: string }): Promise<SampleResult> {
    const bytes = (await this.#retrieve(future.request_id, true)) as Uint8Array;
    const out = SampleResponse.toObject(SampleResponse.decode(bytes), {
      arrays: true,
      defaults: true,
    }) as {
      sequences: { stopReason: number; tokens: Uint8Array; logprobs?: Uint8Array }[];
      promptLogprobs?: Uint8Array;
    };
    return {
      sequences: out.sequences.map((s) => ({
        stopReason: s.stopReason === 1 ? "length" : "stop",
        tokens: ints(s.tokens),
        logprobs: s.logprobs ? [...floats(s.logprobs)] : [],
      })),
      promptLogprobs:
        out.promptLogprobs && out.promptLogprobs.byteLength > 0
          ? [...floats(out.promptLogprobs)].map((v) => (Number.isNaN(v) ? null : v))
          : null,
    };
  }
}

/** One sequence as a datum the SDK's way: input `seq[:-1]`, targets `seq[1:]`, weights per
 * target (`mask[1:]`). */
export function datumOf(tokens: readonly number[], mask: readonly number[]): Datum {
  return {
    tokens: tokens.slice(0, -1),
    targetTokens: tokens.slice(1),
    weights: mask.slice(1).map(Number),
  };
}
