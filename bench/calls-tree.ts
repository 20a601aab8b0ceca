// The call trees the store benches aggregate: 100 roots, depth up to 8 (a root and 7 levels
// below it), three models, each call with its own usage; and prices for those models.
import type { CallBatchItem, Store } from "../packages/store/src/index.ts";

export const MODELS = ["tiny/a", "tiny/b", "tiny/c"] as const;
export const ROOTS = 100;
const T0 = Date.UTC(2026, 0, 1);

/** `total` calls in one project as upsertBatch items, `batchCalls` calls (2 items each) at a
 * time. Deterministic: every run seeds the same trees. Root i is `c<i>`, trace `t<i>`. With
 * `orphans`, each trace also holds a call whose parent never arrives (`o<i>`, not below the
 * root): no trace is then exactly its root's descendants, and every sum walks parent links. */
export function* treeBatches(
  project: string,
  total: number,
  batchCalls = 5000,
  orphans = false,
): Generator<CallBatchItem[]> {
  const depth: number[] = [];
  const roots: number[] = [];
  let items: CallBatchItem[] = [];
  let seed = 42;
  const random = () => {
    seed = (seed * 1103515245 + 12345) & 0x7fffffff;
    return seed / 0x7fffffff;
  };
  for (let i = 0; i < total; i++) {
    let parent = -1;
    if (i >= ROOTS) {
      // A random earlier call whose depth allows a child.
      do parent = Math.floor(random() * i);
      while (depth[parent]! >= 7);
    }
    depth.push(parent < 0 ? 0 : depth[parent]! + 1);
    roots.push(parent < 0 ? i : roots[parent]!);
    const id = `c${i}`;
    const model = MODELS[i % 3]!;
    items.push({
      mode: "start",
      start: {
        project_id: project,
        id,
        trace_id: `t${roots[i]}`,
        parent_id: parent < 0 ? null : `c${parent}`,
        op_name: "llm",
        started_at: new Date(T0 + i).toISOString(),
        inputs: { messages: [{ role: "user", content: "hello" }] },
      },
    });
    items.push({
      mode: "end",
      end: {
        project_id: project,
        id,
        ended_at: new Date(T0 + i + 10).toISOString(),
        output: { content: "hi" },
        summary: {
          usage: {
            [model]: { prompt_tokens: 10, completion_tokens: 5, cache_read_input_tokens: 2 },
          },
        },
      },
    });
    if (items.length >= batchCalls * 2) {
      yield items;
      items = [];
    }
  }
  if (orphans) {
    for (let i = 0; i < ROOTS; i++) {
      const id = `o${i}`;
      items.push(
        {
          mode: "start",
          start: {
            project_id: project,
            id,
            trace_id: `t${i}`,
            parent_id: `ghost${i}`,
            op_name: "llm",
            started_at: new Date(T0).toISOString(),
          },
        },
        {
          mode: "end",
          end: {
            project_id: project,
            id,
            ended_at: new Date(T0 + 10).toISOString(),
            summary: { usage: { [MODELS[0]]: { prompt_tokens: 1000 } } },
          },
        },
      );
    }
  }
  if (items.length) yield items;
}

/** Two default prices per model (the second from 50 s into the calls), and a project's own
 * price for the first model: every call is priced, some at each price. */
export async function seedPrices(store: Store, project: string): Promise<void> {
  for (const [i, model] of MODELS.entries()) {
    await store.prices.set({
      model,
      prompt_token_cost: 0.001 * (i + 1),
      completion_token_cost: 0.002 * (i + 1),
      cache_read_input_token_cost: 0.0005,
      effective_date: "2025-01-01T00:00:00Z",
    });
    await store.prices.set({
      model,
      prompt_token_cost: 0.0008 * (i + 1),
      completion_token_cost: 0.0016 * (i + 1),
      cache_read_input_token_cost: 0.0004,
      effective_date: new Date(T0 + 50_000).toISOString(),
    });
  }
  await store.prices.set({
    model: MODELS[0],
    project_id: project,
    prompt_token_cost: 0.0001,
    completion_token_cost: 0.0002,
    effective_date: "2025-06-01T00:00:00Z",
  });
}
