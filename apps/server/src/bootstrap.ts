import { chmodSync, existsSync, mkdirSync, writeFileSync } from "node:fs";
import { adminKeyPath } from "@arbor/config";
import type { Store } from "@arbor/store";

export const ADMIN_USER = "admin";
export const ADMIN_ENTITY = "default";

export interface FirstStart {
  /** The new admin key: shown once, and written to `keyPath` with mode 0600. */
  token: string;
  keyPath: string;
}

/** On the first start of a store with no users: an admin user, a default entity and a key.
 * Returns undefined when the store already has users. */
export async function ensureFirstAdmin(
  store: Store,
  dataDir: string,
): Promise<FirstStart | undefined> {
  const existing = await store.users.list({ limit: 1 });
  if (existing.data.length > 0) return undefined;
  const user = await store.users.create({
    name: ADMIN_USER,
    defaultEntity: ADMIN_ENTITY,
    role: "admin",
  });
  // The operator's: it reads /metrics too.
  const { token } = await store.apiKeys.create(user.id, {
    name: "first admin key",
    operator: true,
  });
  mkdirSync(dataDir, { recursive: true });
  const keyPath = adminKeyPath(dataDir);
  if (existsSync(keyPath)) chmodSync(keyPath, 0o600);
  writeFileSync(keyPath, `${token}\n`, { mode: 0o600 });
  chmodSync(keyPath, 0o600);
  return { token, keyPath };
}
