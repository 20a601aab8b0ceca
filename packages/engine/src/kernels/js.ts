import type { Kernels } from "./types.ts";
import { weightArray } from "./weight.ts";

export const jsKernels: Kernels = {
  memoryLimit: Number.POSITIVE_INFINITY,
  name: "js",
  workspace: () => ({ f32: (n) => new Float32Array(n), release() {} }),
  matmulNT(out, a, weight, M, N, K, accumulate = false) {
    const b = weightArray(weight);
    for (let m = 0; m < M; m++) {
      const ao = m * K;
      const oo = m * N;
      let n = 0;
      for (; n + 4 <= N; n += 4) {
        const b0 = n * K;
        const b1 = b0 + K;
        const b2 = b1 + K;
        const b3 = b2 + K;
        let s0 = 0;
        let s1 = 0;
        let s2 = 0;
        let s3 = 0;
        for (let k = 0; k < K; k++) {
          const av = a[ao + k]!;
          s0 += av * b[b0 + k]!;
          s1 += av * b[b1 + k]!;
          s2 += av * b[b2 + k]!;
          s3 += av * b[b3 + k]!;
        }
        if (accumulate) {
          out[oo + n] = out[oo + n]! + s0;
          out[oo + n + 1] = out[oo + n + 1]! + s1;
          out[oo + n + 2] = out[oo + n + 2]! + s2;
          out[oo + n + 3] = out[oo + n + 3]! + s3;
        } else {
          out[oo + n] = s0;
          out[oo + n + 1] = s1;
          out[oo + n + 2] = s2;
          out[oo + n + 3] = s3;
        }
      }
      for (; n < N; n++) {
        const bo = n * K;
        let s = 0;
        for (let k = 0; k < K; k++) s += a[ao + k]! * b[bo + k]!;
        out[oo + n] = accumulate ? out[oo + n]! + s : s;
      }
    }
  },
  matmulNN(out, a, weight, M, N, K, accumulate = false) {
    const b = weightArray(weight);
    if (!accumulate) out.fill(0, 0, M * N);
    for (let m = 0; m < M; m++) {
      const oo = m * N;
      for (let k = 0; k < K; k++) {
        const av = a[m * K + k]!;
        if (av === 0) continue;
        const bo = k * N;
        for (let n = 0; n < N; n++) out[oo + n] = out[oo + n]! + av * b[bo + n]!;
      }
    }
  },
  matmulTN(out, a, b, M, N, K, accumulate = false) {
    if (!accumulate) out.fill(0, 0, M * N);
    for (let k = 0; k < K; k++) {
      const bo = k * N;
      for (let m = 0; m < M; m++) {
        const av = a[k * M + m]!;
        if (av === 0) continue;
        const oo = m * N;
        for (let n = 0; n < N; n++) out[oo + n] = out[oo + n]! + av * b[bo + n]!;
      }
    }
  },
  rmsNorm(out, x, weight, rows, D, eps, inv) {
    for (let r = 0; r < rows; r++) {
      const o = r * D;
      let ss = 0;
      for (let i = 0; i < D; i++) ss += x[o + i]! * x[o + i]!;
      const s = 1 / Math.sqrt(ss / D + eps);
      if (inv) inv[r] = s;
      for (let i = 0; i < D; i++) out[o + i] = x[o + i]! * s * weight[i]!;
    }
  },
  rmsNormBackward(dx, dw, dy, x, inv, w, rows, D) {
    for (let r = 0; r < rows; r++) {
      const o = r * D;
      const s = inv[r]!;
      let dot = 0;
      for (let i = 0; i < D; i++) {
        dot += dy[o + i]! * w[i]! * x[o + i]!;
        dw[i] = dw[i]! + dy[o + i]! * x[o + i]! * s;
      }
      const c = (dot * s * s * s) / D;
      for (let i = 0; i < D; i++) dx[o + i] = s * w[i]! * dy[o + i]! - x[o + i]! * c;
    }
  },
  swiglu(out, gate, up, n) {
    for (let i = 0; i < n; i++) {
      const g = gate[i]!;
      out[i] = (g / (1 + Math.exp(-g))) * up[i]!;
    }
  },
  attention(out, q, keys, values, n, start, H, KV, hd, sequences = 1) {
    if (sequences > 1) {
      const [qs, ks] = [n * H * hd, n * KV * hd];
      for (let s = 0; s < sequences; s++) {
        const [sq, sk] = [
          (a: Float32Array) => a.subarray(s * qs),
          (a: Float32Array) => a.subarray(s * ks),
        ];
        jsKernels.attention(sq(out), sq(q), sk(keys), sk(values), n, 0, H, KV, hd);
      }
      return;
    }
    const qDim = H * hd;
    const kvDim = KV * hd;
    const group = H / KV;
    const scale = 1 / Math.sqrt(hd);
    const scores = new Float32Array(start + n);
    for (let t = 0; t < n; t++) {
      const span = start + t + 1;
      for (let h = 0; h < H; h++) {
        const qo = t * qDim + h * hd;
        const kvo = Math.floor(h / group) * hd;
        let max = Number.NEGATIVE_INFINITY;
        for (let j = 0; j < span; j++) {
          const ko = j * kvDim + kvo;
          let s = 0;
          for (let i = 0; i < hd; i++) s += q[qo + i]! * keys[ko + i]!;
          s *= scale;
          scores[j] = s;
          if (s > max) max = s;
        }
        let sum = 0;
        for (let j = 0; j < span; j++) {
          const e = Math.exp(scores[j]! - max);
          scores[j] = e;
          sum += e;
        }
        out.fill(0, qo, qo + hd);
        for (let j = 0; j < span; j++) {
          const p = scores[j]! / sum;
          const vo = j * kvDim + kvo;
          for (let i = 0; i < hd; i++) out[qo + i] = out[qo + i]! + p * values[vo + i]!;
        }
      }
    }
  },
  attentionBackward(dq, dk, dv, q, keys, values, dOut, n, H, KV, hd, sequences = 1) {
    if (sequences > 1) {
      const [qs, ks] = [n * H * hd, n * KV * hd];
      for (let s = 0; s < sequences; s++) {
        const [sq, sk] = [
          (a: Float32Array) => a.subarray(s * qs),
          (a: Float32Array) => a.subarray(s * ks),
        ];
        jsKernels.attentionBackward(
          sq(dq),
          sk(dk),
          sk(dv),
          sq(q),
          sk(keys),
          sk(values),
          sq(dOut),
          n,
          H,
          KV,
          hd,
        );
      }
      return;
    }
    const qDim = H * hd;
    const kvDim = KV * hd;
    const group = H / KV;
    const scale = 1 / Math.sqrt(hd);
    const p = new Float32Array(n);
    const dP = new Float32Array(n);
    for (let t = 0; t < n; t++) {
      for (let h = 0; h < H; h++) {
        const qo = t * qDim + h * hd;
        const kvo = Math.floor(h / group) * hd;
        let max = Number.NEGATIVE_INFINITY;
        for (let j = 0; j <= t; j++) {
          let s = 0;
          for (let i = 0; i < hd; i++) s += q[qo + i]! * keys[j * kvDim + kvo + i]!;
          p[j] = s * scale;
          if (p[j]! > max) max = p[j]!;
        }
        let sum = 0;
        for (let j = 0; j <= t; j++) {
          p[j] = Math.exp(p[j]! - max);
          sum += p[j]!;
        }
        let dot = 0;
        for (let j = 0; j <= t; j++) {
          p[j] = p[j]! / sum;
          const vo = j * kvDim + kvo;
          let s = 0;
          for (let i = 0; i < hd; i++) {
            s += dOut[qo + i]! * values[vo + i]!;
            dv[vo + i] = dv[vo + i]! + p[j]! * dOut[qo + i]!;
          }
          dP[j] = s;
          dot += p[j]! * s;
        }
        for (let j = 0; j <= t; j++) {
          const dS = p[j]! * (dP[j]! - dot) * scale;
          const ko = j * kvDim + kvo;
          for (let i = 0; i < hd; i++) {
            dq[qo + i] = dq[qo + i]! + dS * keys[ko + i]!;
            dk[ko + i] = dk[ko + i]! + dS * q[qo + i]!;
          }
        }
      }
    }
  },
  swigluBackward(dGate, dUp, dOut, gate, up, n) {
    for (let i = 0; i < n; i++) {
      const g = gate[i]!;
      const s = 1 / (1 + Math.exp(-g));
      dUp[i] = dOut[i]! * g * s;
      dGate[i] = dOut[i]! * up[i]! * s * (1 + g * (1 - s));
    }
  },
  softmaxRows(x, rows, cols, scale, rowMax, rowSum) {
    for (let r = 0; r < rows; r++) {
      const o = r * cols;
      let max = Number.NEGATIVE_INFINITY;
      for (let i = 0; i < cols; i++) if (x[o + i]! > max) max = x[o + i]!;
      let sum = 0;
      for (let i = 0; i < cols; i++) {
        const e = Math.exp(x[o + i]! - max);
        x[o + i] = e;
        sum += e;
      }
      rowMax[r] = max;
      rowSum[r] = sum;
      const f = scale[r]! / sum;
      for (let i = 0; i < cols; i++) x[o + i] = x[o + i]! * f;
    }
  },
};
