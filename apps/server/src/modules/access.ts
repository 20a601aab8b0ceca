import { ForbiddenError, InvalidInputError, NAME_PATTERN, quote } from "@arbor/store";

/** Who is calling: the API key's user and the entities that user may act for. */
export interface Principal {
  keyId: string;
  userId: string;
  userName: string;
  defaultEntity: string;
  entities: readonly string[];
  /** An operator's key (ApiKey.operator): it may read `/metrics`. */
  operator: boolean;
}

/** A project the principal may use: `<entity>/<project>`. */
export interface ProjectRef {
  entity: string;
  project: string;
  /** `<entity>/<project>`, as calls store it. */
  id: string;
}

/** `<entity>/<project>`, each part a name (the spec's `ProjectId`); null when it is not one. */
export function parseProjectId(value: string): ProjectRef | null {
  const slash = value.indexOf("/");
  if (slash < 0) return null;
  const entity = value.slice(0, slash);
  const project = value.slice(slash + 1);
  if (!NAME_PATTERN.test(entity) || !NAME_PATTERN.test(project)) return null;
  return { entity, project, id: value };
}

/** The project named by `value`, which the principal must be a member of. `param` names where
 * the value came from, for the error. */
export function projectFor(principal: Principal, value: string, param: string): ProjectRef {
  const ref = parseProjectId(value);
  if (!ref) {
    throw new InvalidInputError(`${param} must be "<entity>/<project>", got ${quote(value)}`, {
      code: "invalid_project",
      param,
    });
  }
  requireEntity(principal, ref.entity);
  return ref;
}

/** The project a request without a project header is recorded under. */
export function defaultProject(principal: Principal): ProjectRef {
  const entity = principal.defaultEntity;
  return { entity, project: "inference", id: `${entity}/inference` };
}

/** Refuses (403) unless the principal is a member of `entity`. */
export function requireEntity(principal: Principal, entity: string): void {
  if (!principal.entities.includes(entity)) {
    throw new ForbiddenError(`This API key may not act for entity ${quote(entity)}.`, {
      code: "permission_denied",
    });
  }
}

/** The first of `find`'s answers over the principal's entities: a row of another entity reads as
 * missing, exactly like one that does not exist. */
export async function findOwned<T>(
  principal: Principal,
  find: (entity: string) => Promise<T | undefined>,
): Promise<T | undefined> {
  for (const entity of principal.entities) {
    const found = await find(entity);
    if (found) return found;
  }
  return undefined;
}
