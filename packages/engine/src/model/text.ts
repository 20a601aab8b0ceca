/**
 * How many characters at the end of `text` may be the start of `marker` (a stop string, a tool
 * call's opening): the length of its longest tail that is a proper prefix of `marker`. A stream
 * holds them back until the next text shows whether the marker follows.
 */
export function heldSuffix(text: string, marker: string): number {
  for (let k = Math.min(marker.length - 1, text.length); k > 0; k--) {
    if (text.endsWith(marker.slice(0, k))) return k;
  }
  return 0;
}
