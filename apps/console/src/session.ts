import { type ArborClient, createArborClient } from "@arbor/client";

/** The API key lives in sessionStorage only: it is gone when the tab closes. */
const KEY = "arbor.console.apiKey";

export function apiKey(): string | null {
  return sessionStorage.getItem(KEY);
}

export function signOut(): void {
  sessionStorage.removeItem(KEY);
  cached = undefined;
}

let cached: { key: string; client: ArborClient } | undefined;

/** The client for the signed-in key: the same public API as every other user of it. */
export function api(): ArborClient {
  const key = apiKey();
  if (!key) throw new Error("Not signed in.");
  if (cached?.key !== key) cached = { key, client: clientFor(key) };
  return cached.client;
}

function clientFor(key: string): ArborClient {
  return createArborClient({ baseUrl: location.origin, apiKey: key, maxRetries: 1 });
}

/** Checks the key with a cheap authenticated call before keeping it. */
export async function signIn(key: string): Promise<void> {
  await clientFor(key).training.models.list({ limit: 1 });
  sessionStorage.setItem(KEY, key);
  cached = undefined;
}
