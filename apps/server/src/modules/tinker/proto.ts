import { fileURLToPath } from "node:url";
import { InvalidInputError } from "@arbor/store";
import protobuf from "protobufjs";

/**
 * Tinker's protobuf messages (ADR 71), read by reflection from Arbor's copy of the schema
 * (`spec/tinker/tinker_public.proto`): the file is the one source, no generated code.
 */
export const PROTO_PATH = fileURLToPath(
  import.meta.resolve("@arbor/spec/tinker/tinker_public.proto"),
);

const root = protobuf.loadSync(PROTO_PATH);
const type = (name: string) => root.lookupType(`tinker_public.${name}`);
export const ForwardBackwardRequest = type("ForwardBackwardRequest");
export const ForwardBackwardOutput = type("ForwardBackwardOutput");
export const SampleResponse = type("SampleResponse");

/** The proto's `DType`. */
export const DType = { UNSPECIFIED: 0, FLOAT32: 1, INT64: 2, INT32: 3, BFLOAT16: 4 } as const;

/** A decoded `Tensor` (protobufjs's plain object: bytes as Uint8Array, enums as numbers). */
export interface TensorObject {
  dense?: Uint8Array;
  sparseCsr?: unknown;
  dtype?: number;
  shape?: (number | string)[];
}

/** A decoded `ForwardBackwardRequest`. */
export interface ForwardBackwardObject {
  modelId: string;
  seqId: number;
  data: {
    modelInput?: { encodedText?: { tokens?: Uint8Array }; image?: unknown; dmel?: unknown }[];
    lossFnInputs?: Record<string, TensorObject>;
  }[];
  lossFn: string;
  lossFnConfig: Record<string, number>;
  forwardOnly: boolean;
}

/** Decodes a protobuf body (400 `invalid_protobuf` when it is not one). */
export function decodeForwardBackward(body: Uint8Array): ForwardBackwardObject {
  try {
    const message = ForwardBackwardRequest.decode(body);
    return ForwardBackwardRequest.toObject(message, {
      longs: Number,
      defaults: true,
      arrays: true,
      objects: true,
    }) as ForwardBackwardObject;
  } catch (err) {
    throw new InvalidInputError(
      `The body is not a tinker_public.ForwardBackwardRequest: ${(err as Error).message}`,
      { code: "invalid_protobuf" },
    );
  }
}

const view = (bytes: Uint8Array) => new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);

/** Little-endian int32 values (`EncodedTextChunk.tokens`, `SampledSequence.tokens`). */
export function int32s(bytes: Uint8Array, what: string): number[] {
  if (bytes.byteLength % 4 !== 0)
    throw new InvalidInputError(`${what} is ${bytes.byteLength} bytes, not int32s`, {
      code: "invalid_tensor",
    });
  const v = view(bytes);
  return Array.from({ length: bytes.byteLength / 4 }, (_, i) => v.getInt32(i * 4, true));
}

/** A dense 1-D tensor's values as numbers (float32, int64 or int32; 400 otherwise). */
export function tensorValues(tensor: TensorObject, what: string): number[] {
  const bad = (why: string): never => {
    throw new InvalidInputError(`loss_fn_inputs.${what}: ${why}`, {
      code: "invalid_tensor",
      param: `loss_fn_inputs.${what}`,
    });
  };
  if (!tensor.dense) return bad("only dense tensors are served (not sparse_csr)");
  const shape = (tensor.shape ?? []).map(Number);
  if (shape.length !== 1) return bad(`shape [${shape}] is not 1-D`);
  const bytes = tensor.dense;
  const v = view(bytes);
  const width = tensor.dtype === DType.INT64 ? 8 : 4;
  const n = bytes.byteLength / width;
  if (n !== shape[0]) return bad(`${bytes.byteLength} bytes do not hold shape [${shape}]`);
  const out = new Array<number>(n);
  for (let i = 0; i < n; i++) {
    switch (tensor.dtype) {
      case DType.FLOAT32:
        out[i] = v.getFloat32(i * 4, true);
        break;
      case DType.INT64:
        out[i] = Number(v.getBigInt64(i * 8, true));
        break;
      case DType.INT32:
        out[i] = v.getInt32(i * 4, true);
        break;
      default:
        return bad(`dtype ${tensor.dtype} is not float32, int64 or int32`);
    }
  }
  return out;
}

const f32bytes = (values: ArrayLike<number>) =>
  new Uint8Array(Float32Array.from(values as number[]).buffer);

/**
 * A `ForwardBackwardOutput`: every datum's `logprobs` in one `ArrayRecord` (float32 bytes
 * concatenated, int64 byte offsets), and the metrics (`name:reduction` keys).
 */
export function encodeForwardBackwardOutput(
  logprobs: readonly Float32Array[],
  metrics: Record<string, number>,
): Uint8Array {
  const offsets = new BigInt64Array(logprobs.length + 1);
  let at = 0;
  logprobs.forEach((l, i) => {
    at += l.byteLength;
    offsets[i + 1] = BigInt(at);
  });
  const data = new Uint8Array(at);
  let o = 0;
  for (const l of logprobs) {
    data.set(new Uint8Array(l.buffer, l.byteOffset, l.byteLength), o);
    o += l.byteLength;
  }
  const message = ForwardBackwardOutput.fromObject({
    lossFnOutputType: "ArrayRecord",
    lossFnOutputs: [
      {
        typeTag: "ArrayRecord",
        numDatums: logprobs.length,
        fields: {
          logprobs: {
            data,
            offsets: new Uint8Array(offsets.buffer),
            dtype: DType.FLOAT32,
            trailingShape: [],
          },
        },
      },
    ],
    metrics,
  });
  return ForwardBackwardOutput.encode(message).finish();
}

/** One sampled sequence of a `SampleResponse`. */
export interface SampledSequence {
  stopReason: "stop" | "length";
  tokens: readonly number[];
  logprobs: readonly number[];
}

/** A `SampleResponse`; `promptLogprobs` float32 with NaN where there is none (position 0). */
export function encodeSampleResponse(
  sequences: readonly SampledSequence[],
  promptLogprobs: readonly number[] | null,
): Uint8Array {
  const message = SampleResponse.fromObject({
    sequences: sequences.map((s) => ({
      stopReason: s.stopReason === "length" ? 1 : 0,
      tokens: new Uint8Array(Int32Array.from(s.tokens).buffer),
      logprobs: f32bytes(s.logprobs),
    })),
    ...(promptLogprobs ? { promptLogprobs: f32bytes(promptLogprobs) } : {}),
  });
  return SampleResponse.encode(message).finish();
}
