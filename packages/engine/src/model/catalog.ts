import { fileURLToPath } from "node:url";
import catalog from "../../models/catalog.json" with { type: "json" };

export interface CatalogEntry {
  id: string;
  description: string;
  architecture: string;
  contextLength: number;
  parameters: number;
  chatTemplate: string;
}

interface RawEntry {
  id: string;
  dir: string;
  description: string;
  architecture: string;
  context_length: number;
  parameters: number;
  chat_template: string;
}

const modelsDir = new URL("../../models/", import.meta.url);

/** The list is imported (bundles, such as the CLI's, carry it); the folders stay beside it. */
function rawCatalog(): RawEntry[] {
  return catalog as RawEntry[];
}

/** The base models shipped with the engine. */
export function listCatalog(): CatalogEntry[] {
  return rawCatalog().map((e) => ({
    id: e.id,
    description: e.description,
    architecture: e.architecture,
    contextLength: e.context_length,
    parameters: e.parameters,
    chatTemplate: e.chat_template,
  }));
}

/** The folder holding a shipped model (config.json, tokenizer.json, model.safetensors). */
export function catalogModelDir(id: string): string {
  const entry = rawCatalog().find((e) => e.id === id);
  if (!entry) throw new Error(`no shipped model ${id}`);
  return fileURLToPath(new URL(`${entry.dir}/`, modelsDir));
}
