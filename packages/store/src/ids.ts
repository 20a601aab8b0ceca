import { randomBytes } from "node:crypto";

let lastMs = 0;
let lastCounter = 0;

/**
 * A UUID v7 (RFC 9562): 48-bit Unix milliseconds, then a 12-bit counter in rand_a so that ids made
 * in the same millisecond by this process still sort in creation order, then 62 random bits.
 */
export function uuidv7(now: number = Date.now()): string {
  let ms = Math.floor(now);
  if (ms <= lastMs) {
    ms = lastMs;
    lastCounter++;
    if (lastCounter > 0xfff) {
      ms = ++lastMs;
      lastCounter = 0;
    }
  } else {
    lastCounter = 0;
  }
  lastMs = ms;
  const b = randomBytes(16);
  b.writeUIntBE(ms, 0, 6);
  b[6] = 0x70 | ((lastCounter >> 8) & 0x0f);
  b[7] = lastCounter & 0xff;
  b[8] = 0x80 | (b[8]! & 0x3f);
  const h = b.toString("hex");
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

/** Unix seconds, as records carry them. */
export function unixSeconds(ms: number): number {
  return Math.floor(ms / 1000);
}
