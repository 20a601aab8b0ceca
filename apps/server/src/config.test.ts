import { join } from "node:path";
import { readConfig } from "@arbor/config";
import { describe, expect, it } from "vitest";
import { appConfigOf } from "./config.ts";

describe("appConfigOf: the key file the sign-in page may name (ADR 67)", () => {
  const dir = join("/srv", "arbor-data");
  it.each(["127.0.0.1", "127.0.0.2", "::1", "localhost"])(
    "when the server listens on %s, then the page names the data directory's admin.key",
    (host) => {
      const config = appConfigOf(readConfig({ ARBOR_HOST: host, ARBOR_DATA_DIR: dir }));
      expect(config.adminKeyPath).toBe(join(dir, "admin.key"));
    },
  );
  it.each(["0.0.0.0", "::", "10.0.0.5", "arbor.example.com"])(
    "when the server listens on %s, then no path is given to a page anyone may open",
    (host) => {
      const config = appConfigOf(readConfig({ ARBOR_HOST: host, ARBOR_DATA_DIR: dir }));
      expect(config.adminKeyPath).toBeUndefined();
    },
  );
});
