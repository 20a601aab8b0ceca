// Types only: the store (node:sqlite) loads when a store command runs (ADR 42).
import type { Store } from "@arbor/store";

/** Output of a command: lines for a person, or one JSON document with `--json`. */
export interface Output {
  line(text: string): void;
}

/** `keys create --user U --entity E [--name N] [--operator]`: the user is created on first use
 * with E as its default entity, and made a member of E otherwise. With `--operator` the key may
 * read `/metrics` too. The key is printed once. */
export async function createKey(
  store: Store,
  args: {
    user: string;
    entity: string;
    name?: string | undefined;
    operator?: boolean | undefined;
  },
  out: Output,
): Promise<string> {
  let user = await store.users.getByName(args.user);
  if (!user) {
    user = await store.users.create({ name: args.user, defaultEntity: args.entity });
  } else if (!(await store.users.isMember(user.id, args.entity))) {
    await store.users.addMembership(user.id, args.entity);
  }
  const { key, token } = await store.apiKeys.create(user.id, {
    name: args.name ?? `${args.entity} key`,
    operator: args.operator === true,
  });
  out.line(
    `Created ${key.operator ? "operator " : ""}key ${key.prefix}… (id ${key.id}) for user "${user.name}" in entity "${args.entity}".`,
  );
  out.line("It is shown once; store it now:");
  out.line(token);
  return token;
}

/** `keys list [--user U]`: prefixes, never tokens. */
export async function listKeys(
  store: Store,
  args: { user?: string | undefined },
  out: Output,
): Promise<void> {
  const users = args.user
    ? [await store.users.getByName(args.user)].filter((u) => u !== undefined)
    : (await store.users.list({ limit: 100 })).data;
  if (args.user && users.length === 0) throw new Error(`No user named "${args.user}".`);
  out.line(
    [
      "user",
      "entities",
      "key id",
      "prefix",
      "name",
      "operator",
      "created",
      "last used",
      "revoked",
    ].join("\t"),
  );
  for (const user of users) {
    const entities = (await store.users.entitiesOf(user.id)).join(",");
    for (const key of await store.apiKeys.list(user.id)) {
      out.line(
        [
          user.name,
          entities,
          key.id,
          `${key.prefix}…`,
          key.name ?? "",
          key.operator ? "yes" : "",
          iso(key.created_at),
          iso(key.last_used_at),
          iso(key.revoked_at),
        ].join("\t"),
      );
    }
  }
}

/** `keys revoke <prefix or id>`: takes effect on the next request. */
export async function revokeKey(store: Store, args: { key: string }, out: Output): Promise<void> {
  const count = await store.apiKeys.revokeByPrefix(args.key.replace(/…$/, ""));
  if (count === 0) throw new Error(`No active key matches "${args.key}".`);
  out.line(`Revoked ${count} key${count === 1 ? "" : "s"}.`);
}

/** `prices set`: per-token prices for a model, by default for every project, from a date on. */
export async function setPrice(
  store: Store,
  args: {
    model: string;
    prompt: number;
    completion: number;
    project?: string | undefined;
    effective?: string | undefined;
    cacheRead?: number | undefined;
    cacheCreation?: number | undefined;
  },
  out: Output,
): Promise<void> {
  const price = await store.prices.set({
    model: args.model,
    project_id: args.project ?? null,
    prompt_token_cost: args.prompt,
    completion_token_cost: args.completion,
    cache_read_input_token_cost: args.cacheRead ?? null,
    cache_creation_input_token_cost: args.cacheCreation ?? null,
    effective_date: args.effective ?? new Date().toISOString(),
  });
  out.line(
    `Price ${price.id}: ${price.model} for ${price.project_id ?? "every project"} from ${price.effective_date}: prompt ${price.prompt_token_cost}/token, completion ${price.completion_token_cost}/token.`,
  );
}

export async function listPrices(
  store: Store,
  args: { project?: string | undefined; model?: string | undefined },
  out: Output,
): Promise<void> {
  const prices = await store.prices.list({
    ...(args.project !== undefined ? { project_id: args.project } : {}),
    ...(args.model !== undefined ? { model: args.model } : {}),
  });
  out.line(
    [
      "id",
      "model",
      "project",
      "effective",
      "prompt/token",
      "completion/token",
      "cache read/token",
      "cache creation/token",
    ].join("\t"),
  );
  for (const p of prices) {
    out.line(
      [
        p.id,
        p.model,
        p.project_id ?? "(default)",
        p.effective_date,
        p.prompt_token_cost,
        p.completion_token_cost,
        p.cache_read_input_token_cost ?? "",
        p.cache_creation_input_token_cost ?? "",
      ].join("\t"),
    );
  }
}

export async function deletePrice(
  store: Store,
  args: { id: string; project?: string | undefined },
  out: Output,
): Promise<void> {
  await store.prices.delete(args.project ?? null, args.id);
  out.line(`Deleted price ${args.id}.`);
}

function iso(seconds: number | null): string {
  return seconds === null ? "" : new Date(seconds * 1000).toISOString();
}

/** `blobs import [--from DIR]`: copies the files of a data directory's blobs (checkpoints,
 * datasets, exports) into the store's blob store, as a server that switched to blobs in
 * PostgreSQL needs (ADR 39). Keys already there are left as they are; each file streams. */
export async function importBlobs(
  store: Store,
  args: { from: string },
  out: Output,
): Promise<{ copied: number; skipped: number }> {
  const target = store.blobs;
  const { FsBlobStore } = await import("@arbor/store");
  const source = new FsBlobStore(args.from);
  if (target instanceof FsBlobStore && target.root === source.root) {
    throw new Error(`${args.from} is this store's own blob directory: nothing to import.`);
  }
  let copied = 0;
  let skipped = 0;
  // What the target holds, listed once (not a round trip per file).
  const present = new Set(await target.list(""));
  for (const key of await source.list("")) {
    if (present.has(key)) {
      skipped++;
      continue;
    }
    const body = await source.stream(key);
    if (!body) continue;
    await target.put(key, body);
    copied++;
  }
  out.line(`Imported ${copied} files from ${args.from} (${skipped} were already there).`);
  return { copied, skipped };
}
