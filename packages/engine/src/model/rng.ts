import { randomInt } from "node:crypto";

/** Seeded PRNG (mulberry32 over a splitmix32-mixed seed). The engine never uses Math.random. */
export class Rng {
  private state: number;

  constructor(seed: number) {
    this.state = mix32(seed >>> 0);
  }

  /** Uniform in [0, 1). */
  next(): number {
    this.state = (this.state + 0x6d2b79f5) | 0;
    let t = this.state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  }

  /** Integer in [0, n). */
  int(n: number): number {
    return Math.floor(this.next() * n);
  }

  /** Standard normal (Box–Muller). */
  normal(): number {
    const u = 1 - this.next();
    const v = this.next();
    return Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * v);
  }

  pick<T>(items: readonly T[]): T {
    const item = items[this.int(items.length)];
    if (item === undefined) throw new Error("pick from an empty list");
    return item;
  }
}

/**
 * Derives an independent stream seed, e.g. for choice i of a request. Every bit of a safe
 * integer counts: seeds that differ only above bit 31 give different streams.
 */
export function deriveSeed(seed: number, stream: number): number {
  const high = Math.floor(seed / 4294967296) >>> 0;
  const low = (seed >>> 0) ^ (high === 0 ? 0 : mix32(high));
  return mix32((low ^ Math.imul(stream + 1, 0x9e3779b9)) >>> 0);
}

/**
 * A fresh seed for a request that names none: sampling without a seed is random, so rollouts of
 * one prompt differ (RL learns from their differences). Drawn from the OS's CSPRNG.
 */
export function randomSeed(): number {
  return randomInt(0, 2 ** 48 - 1);
}

function mix32(x: number): number {
  let z = (x + 0x9e3779b9) | 0;
  z = Math.imul(z ^ (z >>> 16), 0x85ebca6b);
  z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35);
  return (z ^ (z >>> 16)) >>> 0;
}
