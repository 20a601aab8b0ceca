/** Who is calling: the API key's user and the entities that user may act for. */
export interface Principal {
  keyId: string;
  userId: string;
  userName: string;
  defaultEntity: string;
  entities: readonly string[];
}
