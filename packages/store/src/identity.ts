import { createHash, randomBytes } from "node:crypto";
import { type Clock, numOrNull, type Page, type PageOptions, pageLimit, toPage } from "./common.ts";
import { assertName, ConflictError, isUniqueViolation, NotFoundError } from "./errors.ts";
import { unixSeconds, uuidv7 } from "./ids.ts";
import type { Row, Sql } from "./sql.ts";

export const API_KEY_PREFIX = "sk-arb-";
const VISIBLE_PREFIX_LENGTH = API_KEY_PREFIX.length + 6;
/** last_used_at is refreshed at most this often, so verifying a key is not a write per request. */
const LAST_USED_RESOLUTION_S = 60;

export interface Entity {
  name: string;
  created_at: number;
}

export interface User {
  id: string;
  name: string;
  default_entity: string;
  created_at: number;
}

export interface Membership {
  user_id: string;
  entity: string;
  role: string;
  created_at: number;
}

export interface ApiKey {
  id: string;
  user_id: string;
  name: string | null;
  /** The visible start of the token, e.g. `sk-arb-Ab12Cd`: enough to recognise it in a list. */
  prefix: string;
  /** An operator's key: it may read what spans every tenant (`GET /metrics`), whatever its
   * entities. Only `arbor keys create --operator` (and the first start) make one. */
  operator: boolean;
  created_at: number;
  last_used_at: number | null;
  revoked_at: number | null;
}

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

function toUser(r: Row): User {
  return {
    id: String(r.id),
    name: String(r.name),
    default_entity: String(r.default_entity),
    created_at: Number(r.created_at),
  };
}

function toApiKey(r: Row): ApiKey {
  return {
    id: String(r.id),
    user_id: String(r.user_id),
    name: r.name === null || r.name === undefined ? null : String(r.name),
    prefix: String(r.prefix),
    operator: Number(r.operator) === 1,
    created_at: Number(r.created_at),
    last_used_at: numOrNull(r.last_used_at),
    revoked_at: numOrNull(r.revoked_at),
  };
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
    const row = await this.#sql.one("SELECT name, created_at FROM entities WHERE name = $1", [
      name,
    ]);
    return { name: String(row!.name), created_at: Number(row!.created_at) };
  }

  async get(name: string): Promise<Entity | undefined> {
    const row = await this.#sql.one("SELECT name, created_at FROM entities WHERE name = $1", [
      name,
    ]);
    return row ? { name: String(row.name), created_at: Number(row.created_at) } : undefined;
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
        const row = await tx.one(
          `INSERT INTO users (id, name, default_entity, created_at) VALUES ($1, $2, $3, $4)
           RETURNING id, name, default_entity, created_at`,
          [uuidv7(now), input.name, input.defaultEntity, unixSeconds(now)],
        );
        await tx.exec(
          "INSERT INTO memberships (user_id, entity, role, created_at) VALUES ($1, $2, $3, $4)",
          [String(row!.id), input.defaultEntity, input.role ?? "admin", unixSeconds(now)],
        );
        return toUser(row!);
      });
    } catch (err) {
      if (isUniqueViolation(err)) throw new ConflictError(`User ${input.name} already exists`);
      throw err;
    }
  }

  async get(id: string): Promise<User | undefined> {
    const row = await this.#sql.one("SELECT * FROM users WHERE id = $1", [id]);
    return row ? toUser(row) : undefined;
  }

  async getByName(name: string): Promise<User | undefined> {
    const row = await this.#sql.one("SELECT * FROM users WHERE name = $1", [name]);
    return row ? toUser(row) : undefined;
  }

  async list(options: PageOptions = {}): Promise<Page<User>> {
    const limit = pageLimit(options.limit);
    const rows = await this.#sql.query(
      "SELECT * FROM users WHERE (CAST($1 AS TEXT) IS NULL OR id > $1) ORDER BY id LIMIT $2",
      [options.after ?? null, limit + 1],
    );
    return toPage(rows.map(toUser), limit);
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
        `INSERT INTO memberships (user_id, entity, role, created_at) VALUES ($1, $2, $3, $4)
         ON CONFLICT (user_id, entity) DO UPDATE SET role = excluded.role
         RETURNING user_id, entity, role, created_at`,
        [userId, entity, role, now],
      );
      return {
        user_id: String(row!.user_id),
        entity: String(row!.entity),
        role: String(row!.role),
        created_at: Number(row!.created_at),
      };
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
      "SELECT role FROM memberships WHERE user_id = $1 AND entity = $2",
      [userId, entity],
    );
    return row ? String(row.role) : undefined;
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
       VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING *`,
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
    return { key: toApiKey(row!), token };
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
    if (row.revoked_at !== null && row.revoked_at !== undefined) return undefined;
    const now = unixSeconds(this.#now());
    const lastUsed = numOrNull(row.last_used_at);
    if (lastUsed === null || now - lastUsed >= LAST_USED_RESOLUTION_S) {
      await this.#sql.exec("UPDATE api_keys SET last_used_at = $2 WHERE id = $1", [
        String(row.id),
        now,
      ]);
    }
    return {
      key_id: String(row.id),
      user_id: String(row.user_id),
      user_name: String(row.user_name),
      default_entity: String(row.default_entity),
      entities: await entitiesOf(this.#sql, String(row.user_id)),
      operator: Number(row.operator) === 1,
    };
  }

  async list(userId: string): Promise<ApiKey[]> {
    const rows = await this.#sql.query("SELECT * FROM api_keys WHERE user_id = $1 ORDER BY id", [
      userId,
    ]);
    return rows.map(toApiKey);
  }

  /** Revokes a key of this user; takes effect on the next verify(). */
  async revoke(userId: string, keyId: string): Promise<ApiKey> {
    const row = await this.#sql.one(
      `UPDATE api_keys SET revoked_at = COALESCE(revoked_at, $3) WHERE id = $1 AND user_id = $2
       RETURNING *`,
      [keyId, userId, unixSeconds(this.#now())],
    );
    if (!row) throw new NotFoundError(`API key ${keyId} not found`);
    return toApiKey(row);
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
  const rows = await sql.query<{ entity: string }>(
    "SELECT entity FROM memberships WHERE user_id = $1 ORDER BY entity",
    [userId],
  );
  return rows.map((r) => String(r.entity));
}
