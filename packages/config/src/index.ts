export {
  adminKeyPath,
  baseModelsDir,
  type Config,
  ROLES,
  type Role,
  readConfig,
  SETTINGS,
  type Setting,
  type Settings,
  settingsTable,
  type UpstreamConfig,
} from "./settings.ts";
