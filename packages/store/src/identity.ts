import { createHash, randomBytes } from "node:crypto";
import { type Clock, type Page, type PageOptions, pageLimit, toPage } from "./common.ts";
import { assertName, ConflictError, isUniqueViolation, NotFoundError } from "./errors.ts";
import { unixSeconds, uuidv7 } from "./ids.ts";
import { bool, num, numOrNull, type RowOf, rowSchema, str, strOrNull } from "./rows.ts";
import type { Sql } from "./sql.ts";

export const API_KEY_PREFIX = "sk-arb-";
const VISIBLE_PREFIX_LENGTH = API_KEY_PREFIX.length + 6;
/** last_used_at is refreshed at most this often, so verifying a key is not a write per request. */
const LAST_USED_RESOLUTION_S = 60;

/** The `entities` table. */
const ENTITIES = rowSchema({ name: str, created_at: num });
export interface Entity extends RowOf<typeof ENTITIES> {}

/** The `users` table. */
const USERS = rowSchema({ id: str, name: str, default_entity: str, created_at: num });
export interface User extends RowOf<typeof USERS> {}

/** The `memberships` table. */
const MEMBERSHIPS = rowSchema({ user_id: str, entity: str, role: str, created_at: num });
export interface Membership extends RowOf<typeof MEMBERSHIPS> {}
/** The entities of a user's memberships (from the key's index alone), and a user's role. */
const MEMBER_ENTITY = MEMBERSHIPS.pick("entity");
const MEMBER_ROLE = MEMBERSHIPS.pick("role");

/** The `api_keys` table, less the token's `hash`. */
const API_KEYS = rowSchema({
  id: str,
  user_id: str,
  name: strOrNull,
  /** The visible start of the token, e.g. `sk-arb-Ab12Cd`: enough to recognise it in a list. */
  prefix: str,
  /** An operator's key: it may read what spans every tenant (`GET /metrics`), whatever its
   * entities. Only `arbor keys create --operator` (and the first start) make one. */
  operator: bool,
  created_at: num,
  last_used_at: numOrNull,
  revoked_at: numOrNull,
});
export interface ApiKey extends RowOf<typeof API_KEYS> {}

/** A key looked up by its hash, with its user. */
const KEY_HOLDERS = rowSchema({
  id: str,
  revoked_at: numOrNull,
  last_used_at: numOrNull,
  operator: bool,
  user_id: str,
  user_name: str,
  default_entity: str,
});

/** What a verified key grants: the caller and the entities it may act on. */
export interface KeyIdentity {
  key_id: string;
  user_id: string;
  user_name: string;
  default_entity: string;
  entities: string[];
  /** Whether the key is an operator's (ApiKey.operator). */
  operator: boolean;
}

function hashToken(token: string): string {
  return createHash("sha256").update(token, "utf8").digest("hex");
}

export class EntitiesRepo {
  readonly #sql: Sql;
  readonly #now: Clock;
  constructor(sql: Sql, now: Clock) {
    this.#sql = sql;
    this.#now = now;
  }

  /** Creates the entity if missing; returns it either way. */
  async ensure(name: string): Promise<Entity> {
    assertName(name, "An entity name");
    await this.#sql.exec(
      "INSERT INTO entities (name, created_at) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
      [name, unixSeconds(this.#now())],
    );
    const row = await this.#sql.one(`SELECT ${ENTITIES.columns()} FROM entities WHERE name = $1`, [
      name,
    ]);
    return ENTITIES.read(row!);
  }

  async get(name: string): Promise<Entity | undefined> {
    const row = await this.#sql.one(`SELECT ${ENTITIES.columns()} FROM entities WHERE name = $1`, [
      name,
    ]);
    return row ? ENTITIES.read(row) : undefined;
  }
}

export class UsersRepo {
  readonly #sql: Sql;
  readonly #now: Clock;
  constructor(sql: Sql, now: Clock) {
    this.#sql = sql;
    this.#now = now;
  }

  /**
   * Creates a user whose default entity is `defaultEntity` (created when missing), and makes the
   * user a member of it. A taken name → ConflictError.
   */
  async create(input: { name: string; defaultEntity: string; role?: string }): Promise<User> {
    assertName(input.defaultEntity, "An entity name");
    const now = this.#now();
    try {
      return await this.#sql.transaction(async (tx) => {
        await tx.exec(
          "INSERT INTO entities (name, created_at) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
          [input.defaultEntity, unixSeconds(now)],
        );
        const user = USERS.read(
          (await tx.one(
            `INSERT INTO users (${USERS.columns()}) VALUES ($1, $2, $3, $4)
             RETURNING ${USERS.columns()}`,
            [uuidv7(now), input.name, input.defaultEntity, unixSeconds(now)],
          ))!,
        );
        await tx.exec(
          `INSERT INTO memberships (${MEMBERSHIPS.columns()}) VALUES ($1, $2, $3, $4)`,
          [user.id, input.defaultEntity, input.role ?? "admin", unixSeconds(now)],
        );
        return user;
      });
    } catch (err) {
      if (isUniqueViolation(err)) throw new ConflictError(`User ${input.name} already exists`);
      throw err;
    }
  }

  async get(id: string): Promise<User | undefined> {
    const row = await this.#sql.one(`SELECT ${USERS.columns()} FROM users WHERE id = $1`, [id]);
    return row ? USERS.read(row) : undefined;
  }

  async getByName(name: string): Promise<User | undefined> {
    const row = await this.#sql.one(`SELECT ${USERS.columns()} FROM users WHERE name = $1`, [name]);
    return row ? USERS.read(row) : undefined;
  }

  async list(options: PageOptions = {}): Promise<Page<User>> {
    const limit = pageLimit(options.limit);
    const rows = await this.#sql.query(
      `SELECT ${USERS.columns()} FROM users WHERE (CAST($1 AS TEXT) IS NULL OR id > $1) ORDER BY id LIMIT $2`,
      [options.after ?? null, limit + 1],
    );
    return toPage(rows.map(USERS.read), limit);
  }

  async setDefaultEntity(userId: string, entity: string): Promise<void> {
    const n = await this.#sql.exec(
      `UPDATE users SET default_entity = $2 WHERE id = $1
       AND EXISTS (SELECT 1 FROM memberships m WHERE m.user_id = $1 AND m.entity = $2)`,
      [userId, entity],
    );
    if (n === 0) throw new NotFoundError(`User ${userId} is not a member of ${entity}`);
  }

  /** Adds (or re-roles) a membership; the entity is created when missing. */
  async addMembership(userId: string, entity: string, role = "member"): Promise<Membership> {
    assertName(entity, "An entity name");
    const now = unixSeconds(this.#now());
    return this.#sql.transaction(async (tx) => {
      await tx.exec(
        "INSERT INTO entities (name, created_at) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
        [entity, now],
      );
      const row = await tx.one(
        `INSERT INTO memberships (${MEMBERSHIPS.columns()}) VALUES ($1, $2, $3, $4)
         ON CONFLICT (user_id, entity) DO UPDATE SET role = excluded.role
         RETURNING ${MEMBERSHIPS.columns()}`,
        [userId, entity, role, now],
      );
      return MEMBERSHIPS.read(row!);
    });
  }

  async removeMembership(userId: string, entity: string): Promise<boolean> {
    const n = await this.#sql.exec(
      `DELETE FROM memberships WHERE user_id = $1 AND entity = $2
       AND entity <> (SELECT default_entity FROM users WHERE id = $1)`,
      [userId, entity],
    );
    return n > 0;
  }

  async entitiesOf(userId: string): Promise<string[]> {
    return entitiesOf(this.#sql, userId);
  }

  /** The user's role in `entity` (`admin`, `member`, …), or undefined when not a member. */
  async roleIn(userId: string, entity: string): Promise<string | undefined> {
    const row = await this.#sql.one(
      `SELECT ${MEMBER_ROLE.columns()} FROM memberships WHERE user_id = $1 AND entity = $2`,
      [userId, entity],
    );
    return row ? MEMBER_ROLE.read(row).role : undefined;
  }

  async isMember(userId: string, entity: string): Promise<boolean> {
    const row = await this.#sql.one(
      "SELECT 1 AS ok FROM memberships WHERE user_id = $1 AND entity = $2",
      [userId, entity],
    );
    return row !== undefined;
  }
}

export class ApiKeysRepo {
  readonly #sql: Sql;
  readonly #now: Clock;
  constructor(sql: Sql, now: Clock) {
    this.#sql = sql;
    this.#now = now;
  }

  /** Creates a key (an operator's with `operator`); the token is returned once here and never
   * stored (only its sha256). */
  async create(
    userId: string,
    options: { name?: string; operator?: boolean } = {},
  ): Promise<{ key: ApiKey; token: string }> {
    const token = API_KEY_PREFIX + randomBytes(32).toString("base64url");
    const now = this.#now();
    const row = await this.#sql.one(
      `INSERT INTO api_keys (id, user_id, name, prefix, hash, operator, created_at)
       VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING ${API_KEYS.columns()}`,
      [
        uuidv7(now),
        userId,
        options.name ?? null,
        token.slice(0, VISIBLE_PREFIX_LENGTH),
        hashToken(token),
        options.operator ? 1 : 0,
        unixSeconds(now),
      ],
    );
    return { key: API_KEYS.read(row!), token };
  }

  /**
   * The identity behind a bearer token, or undefined when it is malformed, unknown or revoked.
   * The lookup is by the token's SHA-256 (the token itself never meets an index or a
   * comparison, so lookup timing says nothing about it).
   */
  async verify(token: string): Promise<KeyIdentity | undefined> {
    if (!token.startsWith(API_KEY_PREFIX) || token.length > 200) return undefined;
    const hash = hashToken(token);
    const row = await this.#sql.one(
      `SELECT k.id, k.revoked_at, k.last_used_at, k.operator, u.id AS user_id,
              u.name AS user_name, u.default_entity
       FROM api_keys k JOIN users u ON u.id = k.user_id WHERE k.hash = $1`,
      [hash],
    );
    if (!row) return undefined;
    const key = KEY_HOLDERS.read(row);
    if (key.revoked_at !== null) return undefined;
    const now = unixSeconds(this.#now());
    if (key.last_used_at === null || now - key.last_used_at >= LAST_USED_RESOLUTION_S) {
      await this.#sql.exec("UPDATE api_keys SET last_used_at = $2 WHERE id = $1", [key.id, now]);
    }
    return {
      key_id: key.id,
      user_id: key.user_id,
      user_name: key.user_name,
      default_entity: key.default_entity,
      entities: await entitiesOf(this.#sql, key.user_id),
      operator: key.operator,
    };
  }

  async list(userId: string): Promise<ApiKey[]> {
    const rows = await this.#sql.query(
      `SELECT ${API_KEYS.columns()} FROM api_keys WHERE user_id = $1 ORDER BY id`,
      [userId],
    );
    return rows.map(API_KEYS.read);
  }

  /** Revokes a key of this user; takes effect on the next verify(). */
  async revoke(userId: string, keyId: string): Promise<ApiKey> {
    const row = await this.#sql.one(
      `UPDATE api_keys SET revoked_at = COALESCE(revoked_at, $3) WHERE id = $1 AND user_id = $2
       RETURNING ${API_KEYS.columns()}`,
      [keyId, userId, unixSeconds(this.#now())],
    );
    if (!row) throw new NotFoundError(`API key ${keyId} not found`);
    return API_KEYS.read(row);
  }

  /** Revokes by visible prefix or id (for the CLI, where the user only sees the prefix). */
  async revokeByPrefix(prefix: string): Promise<number> {
    return this.#sql.exec(
      "UPDATE api_keys SET revoked_at = $2 WHERE (prefix = $1 OR id = $1) AND revoked_at IS NULL",
      [prefix, unixSeconds(this.#now())],
    );
  }
}

/** The entities a user belongs to, by name. */
async function entitiesOf(sql: Sql, userId: string): Promise<string[]> {
  const rows = await sql.query(
    `SELECT ${MEMBER_ENTITY.columns()} FROM memberships WHERE user_id = $1 ORDER BY entity`,
    [userId],
  );
  return rows.map((r) => MEMBER_ENTITY.read(r).entity);
}
