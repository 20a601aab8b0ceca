import type { Client } from "openapi-fetch";
import { type FetchResult, unwrap } from "./errors.ts";
import type { paths } from "./generated/schema.ts";
import { type RetryOptions, retryingFetch } from "./retries.ts";

/** Options of one request; each overrides the client's own. */
export interface RequestOptions {
  /** Milliseconds to wait for the answer's headers, per attempt (not for a stream's body). */
  timeout?: number;
  /** Aborts the request, or a stream being read. */
  signal?: AbortSignal;
  /** Extra headers; an `Idempotency-Key` makes any POST safe to retry. */
  headers?: Record<string, string>;
  /** Retries after the first attempt. */
  maxRetries?: number;
}

/** openai-node's default: 10 minutes. */
export const DEFAULT_TIMEOUT_MS = 10 * 60 * 1000;
export const DEFAULT_MAX_RETRIES = 2;

/** What every resource needs: the raw openapi-fetch client, and the request options of a call. */
export interface Core {
  api: Client<paths>;
  /** openapi-fetch's per-request fields for these options (signal, headers, fetch). */
  init(options?: RequestOptions): {
    signal?: AbortSignal;
    headers?: Record<string, string>;
    fetch: (request: Request) => Promise<Response>;
  };
  sleep(ms: number): Promise<void>;
}

export function createCore(
  api: Client<paths>,
  defaults: Omit<RetryOptions, "timeout" | "maxRetries"> & { timeout: number; maxRetries: number },
): Core {
  const fetchers = new Map<string, (request: Request) => Promise<Response>>();
  return {
    api,
    sleep: defaults.sleep,
    init(options = {}) {
      const maxRetries = options.maxRetries ?? defaults.maxRetries;
      const timeout = options.timeout ?? defaults.timeout;
      const key = `${maxRetries}/${timeout}`;
      let fetch = fetchers.get(key);
      if (!fetch) {
        fetch = retryingFetch({ ...defaults, maxRetries, timeout });
        fetchers.set(key, fetch);
      }
      return { signal: options.signal, headers: options.headers, fetch };
    },
  };
}

/** Awaits an openapi-fetch call and unwraps it. */
export async function data<T>(call: Promise<FetchResult<T>>): Promise<T> {
  return unwrap(await call);
}

/** A list endpoint's answer: one page, with the cursor of its last item. */
export interface ListBody<Item> {
  data: Item[];
  has_more?: boolean;
  last_id?: string | null;
}

/** One page of a list, and the way to the next. */
export interface Page<Item> {
  data: Item[];
  has_more: boolean;
  first_id: string | null;
  last_id: string | null;
  hasNextPage(): boolean;
  /** The page after this one; throws when there is none. */
  nextPage(): Promise<Page<Item>>;
}

/**
 * A list call, as openai-node's PagePromise: `await` it for the first page, or iterate it with
 * `for await` for every item of every page, fetched as the loop needs them.
 */
export class PagePromise<Item> implements PromiseLike<Page<Item>>, AsyncIterable<Item> {
  readonly #fetchPage: (after: string | undefined) => Promise<ListBody<Item>>;
  #first: Promise<Page<Item>> | undefined;

  constructor(fetchPage: (after: string | undefined) => Promise<ListBody<Item>>) {
    this.#fetchPage = fetchPage;
  }

  #page(after: string | undefined): Promise<Page<Item>> {
    return this.#fetchPage(after).then((body) => {
      const last = body.last_id ?? idOf(body.data.at(-1));
      const hasMore = body.has_more === true && last !== null;
      return {
        data: body.data,
        has_more: hasMore,
        first_id: "first_id" in body ? (body.first_id as string | null) : idOf(body.data[0]),
        last_id: last,
        hasNextPage: () => hasMore,
        nextPage: () => {
          if (!hasMore) return Promise.reject(new Error("There is no next page."));
          return this.#page(last ?? undefined);
        },
      };
    });
  }

  // biome-ignore lint/suspicious/noThenProperty: awaiting a list call gives its first page, as openai-node's PagePromise does.
  then<A = Page<Item>, B = never>(
    onfulfilled?: ((page: Page<Item>) => A | PromiseLike<A>) | null,
    onrejected?: ((reason: unknown) => B | PromiseLike<B>) | null,
  ): Promise<A | B> {
    this.#first ??= this.#page(undefined);
    return this.#first.then(onfulfilled, onrejected);
  }

  async *[Symbol.asyncIterator](): AsyncIterator<Item> {
    let page: Page<Item> = await this;
    for (;;) {
      yield* page.data;
      if (!page.hasNextPage()) return;
      page = await page.nextPage();
    }
  }
}

function idOf(item: unknown): string | null {
  if (typeof item === "object" && item !== null && "id" in item) {
    const id = (item as { id: unknown }).id;
    if (typeof id === "string") return id;
  }
  return null;
}
