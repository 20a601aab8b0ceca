import { type ChatMessage, renderChat } from "./chat.ts";
import type { Tokenizer } from "./tokenizer.ts";
import type { TrainBatch } from "./train.ts";

/**
 * One row per conversation, for SFT: inputs are the rendered ChatML tokens, targets the next
 * token, and the loss weight is 1 only where the target is assistant output (content and
 * `<|im_end|>`). Rows are right-padded with `padToken` (weight 0) or cut at `seqLen`.
 */
export function batchFromChats(
  tokenizer: Tokenizer,
  conversations: readonly (readonly ChatMessage[])[],
  options: { seqLen: number; padToken: number },
): TrainBatch {
  const B = conversations.length;
  const T = options.seqLen;
  const inputs = new Int32Array(B * T).fill(options.padToken);
  const targets = new Int32Array(B * T).fill(options.padToken);
  const lossMask = new Float32Array(B * T);
  conversations.forEach((messages, b) => {
    const { tokens, assistantMask } = renderChat(tokenizer, messages);
    const n = Math.min(T, tokens.length - 1);
    for (let t = 0; t < n; t++) {
      inputs[b * T + t] = tokens[t]!;
      targets[b * T + t] = tokens[t + 1]!;
      lossMask[b * T + t] = assistantMask[t + 1]!;
    }
  });
  return { batchSize: B, seqLen: T, inputs, targets, lossMask };
}
