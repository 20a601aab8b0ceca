/**
 * Int8 block-quantized weights ("q8", ADR 61): what the WASM kernels keep in their arena and
 * the plain-JS reference of their arithmetic.
 *
 * A Linear weight W[N,K] (N a multiple of 4, K of 32) is held as quads of 4 rows (4 output
 * columns of the GEMM), each quad a run of K/32 blocks of 144 bytes:
 * - a 16-byte header, one 32-bit lane per row c: the low 16 bits −Σq (the block's quantized
 *   weights summed, negated), the high 16 the block's scale d as a BF16 number;
 * - 128 bytes of weights: 8 groups of 16 bytes, group g holding, for rows c = 0…3 in turn, the
 *   4 weights q[c][4g…4g+3] (so one 32-bit lane is one row's 4 consecutive k: what an int8
 *   dot product sums into that lane).
 * W[n][k] ≈ d·q with q in [−127, 127]; d = max|w| / 127 rounded up to a BF16 number (exact in
 * the header's 16 bits, and never letting a quantized weight pass 127).
 *
 * Activations are quantized per row and per block of 32 as the GEMM runs, to 8 bits as Q8_0's
 * are: x ≈ s·q, q in [−127, 127], s = max|x| / 127, kept as signed bytes. For a block,
 * Σ w·x ≈ d·s·Σ w·q, the integer sum exact. `i32x4.relaxed_dot_i8x16_i7x16_add_s` needs its
 * second operand in [0, 127], so the kernels multiply |w| by q with w's sign (w·q = |w|·(±q)),
 * one dot product per 16 weights (ADR 61). The header's −Σq is what the first kernels used
 * (activations offset by 127, in two 7-bit halves); the reference still sums that way, which
 * gives the same integers. (7-bit activations moved the shipped tiny model's next-token
 * distributions 1.7e-3 in KL divergence, past the 1e-3 bound.)
 */

/** Weights per block (one scale). */
export const Q8_BLOCK = 32;
/** Bytes of one quad's block: the header and 4 × 32 weights. */
export const Q8_QUAD_BLOCK_BYTES = 16 + 4 * Q8_BLOCK;
/** The activation offset: u = round(x / s) + 127. */
export const Q8_OFFSET = 127;

/** Whether a [rows, cols] weight can be held in q8 (else its kernels keep it in BF16). */
export function q8Fits(rows: number, cols: number): boolean {
  return rows % 4 === 0 && cols % Q8_BLOCK === 0 && cols > 0;
}

/** Bytes of a [rows, cols] weight in q8 (`q8Fits`): 9 bits a weight. */
export function q8Bytes(rows: number, cols: number): number {
  return (rows / 4) * (cols / Q8_BLOCK) * Q8_QUAD_BLOCK_BYTES;
}

/** Bytes from one quad to the next. */
export function q8QuadStride(cols: number): number {
  return (cols / Q8_BLOCK) * Q8_QUAD_BLOCK_BYTES;
}

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** The smallest BF16 number ≥ x (x ≥ 0 and finite), as its 16 bits. */
function bf16Up(x: number): number {
  f32[0] = x;
  const bits = u32[0]!;
  return (bits >>> 16) + ((bits & 0xffff) !== 0 ? 1 : 0);
}

/** A BF16 number's value. */
function bf16Value(bits: number): number {
  u32[0] = bits << 16;
  return f32[0]!;
}

/**
 * Quantizes rows [r0, r0 + data.length / cols) of a [rows, cols] weight (r0 a multiple of 4) into
 * `bytes`, the weight's q8 layout (see above); rows past the data are left as they are.
 */
export function quantizeQ8Rows(
  bytes: Uint8Array,
  cols: number,
  r0: number,
  data: Float32Array,
): void {
  const n = data.length / cols;
  const blocks = cols / Q8_BLOCK;
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const stride = q8QuadStride(cols);
  for (let r = 0; r < n; r++) {
    const row = r0 + r;
    const quad = row >> 2;
    const c = row & 3;
    for (let b = 0; b < blocks; b++) {
      const o = r * cols + b * Q8_BLOCK;
      let max = 0;
      for (let t = 0; t < Q8_BLOCK; t++) max = Math.max(max, Math.abs(data[o + t]!));
      const scaleBits = max > 0 ? bf16Up(Math.fround(max / 127)) : 0;
      const d = bf16Value(scaleBits);
      const at = quad * stride + b * Q8_QUAD_BLOCK_BYTES;
      let sum = 0;
      for (let t = 0; t < Q8_BLOCK; t++) {
        const q = d > 0 ? Math.max(-127, Math.min(127, Math.round(data[o + t]! / d))) : 0;
        sum += q;
        view.setInt8(at + 16 + (t >> 2) * 16 + c * 4 + (t & 3), q);
      }
      view.setUint32(at + c * 4, ((scaleBits << 16) | (-sum & 0xffff)) >>> 0, true);
    }
  }
}

/** Rows [r0, r1) of a q8 weight, dequantized (d·q) to row-major F32 in `out`. */
export function dequantizeQ8Rows(
  bytes: Uint8Array,
  cols: number,
  r0: number,
  r1: number,
  out: Float32Array,
): Float32Array {
  const blocks = cols / Q8_BLOCK;
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const stride = q8QuadStride(cols);
  for (let row = r0; row < r1; row++) {
    const c = row & 3;
    const o = (row - r0) * cols;
    for (let b = 0; b < blocks; b++) {
      const at = (row >> 2) * stride + b * Q8_QUAD_BLOCK_BYTES;
      const d = bf16Value(view.getUint32(at + c * 4, true) >>> 16);
      for (let t = 0; t < Q8_BLOCK; t++) {
        out[o + b * Q8_BLOCK + t] = d * view.getInt8(at + 16 + (t >> 2) * 16 + c * 4 + (t & 3));
      }
    }
  }
  return out;
}

/** x rounded to the nearest integer, ties to even (as `f32x4.nearest`). */
function nearestEven(x: number): number {
  const r = Math.round(x);
  return r - x === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/**
 * Quantizes M rows of K activations (K a multiple of 32) as the kernels do: per block of 32,
 * s = max|x| / 127 (F32), u = nearest(x · (127 / max|x|)) + 127 in [0, 254] (0 blocks: s = 0,
 * u = 127). Returns u [M, K] and s [M, K/32]; the kernels keep q = u − 127 as signed bytes.
 */
export function quantizeActivations(
  a: Float32Array,
  M: number,
  K: number,
): { u: Uint8Array; s: Float32Array } {
  const blocks = K / Q8_BLOCK;
  const u = new Uint8Array(M * K);
  const s = new Float32Array(M * blocks);
  for (let m = 0; m < M; m++) {
    for (let b = 0; b < blocks; b++) {
      const o = m * K + b * Q8_BLOCK;
      let max = 0;
      for (let t = 0; t < Q8_BLOCK; t++) max = Math.max(max, Math.abs(a[o + t]!));
      const inv = max > 0 ? Math.fround(127 / max) : 0;
      s[m * blocks + b] = Math.fround(max / 127);
      for (let t = 0; t < Q8_BLOCK; t++) {
        u[o + t] = nearestEven(Math.fround(a[o + t]! * inv)) + Q8_OFFSET;
      }
    }
  }
  return { u, s };
}

/**
 * The reference of the kernels' q8 GEMM: out[M,N] (+)= A·Wᵀ with W in q8 (`bytes`, [N,K]) and
 * A quantized by `quantizeActivations`: for each block in order, out += (Σ q·u − 127·Σq)·(d·s),
 * in F32 (the kernels may fuse the multiply-add: results agree to F32 rounding).
 */
export function matmulQ8Reference(
  out: Float32Array,
  a: Float32Array,
  bytes: Uint8Array,
  M: number,
  N: number,
  K: number,
  accumulate = false,
): void {
  const { u, s } = quantizeActivations(a, M, K);
  const blocks = K / Q8_BLOCK;
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const stride = q8QuadStride(K);
  for (let m = 0; m < M; m++) {
    for (let n = 0; n < N; n++) {
      const c = n & 3;
      let acc = accumulate ? out[m * N + n]! : 0;
      for (let b = 0; b < blocks; b++) {
        const at = (n >> 2) * stride + b * Q8_QUAD_BLOCK_BYTES;
        const header = view.getUint32(at + c * 4, true);
        let dot = ((header << 16) >> 16) * Q8_OFFSET;
        for (let t = 0; t < Q8_BLOCK; t++) {
          dot += view.getInt8(at + 16 + (t >> 2) * 16 + c * 4 + (t & 3)) * u[m * K + b * 32 + t]!;
        }
        const ds = Math.fround(bf16Value(header >>> 16) * s[m * blocks + b]!);
        acc = Math.fround(acc + Math.fround(dot * ds));
      }
      out[m * N + n] = acc;
    }
  }
}
