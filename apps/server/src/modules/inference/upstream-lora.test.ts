import { mkdirSync, mkdtempSync, readdirSync, rmSync, utimesSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { MemoryBlobStore } from "@arbor/store";
import { pino } from "pino";
import { afterEach, describe, expect, it } from "vitest";
import { UpstreamAdapters } from "./upstream-lora.ts";

const dirs: string[] = [];
afterEach(() => {
  for (const dir of dirs.splice(0)) rmSync(dir, { recursive: true, force: true });
});

describe("UpstreamAdapters.sweepPartial", () => {
  it("when a write was cut off long ago, then its temporary folder goes; a recent one and complete folders stay", async () => {
    const dir = mkdtempSync(join(tmpdir(), "arbor-upstream-lora-"));
    dirs.push(dir);
    const folder = (name: string, ageMs: number) => {
      mkdirSync(join(dir, name));
      writeFileSync(join(dir, name, "adapter_config.json"), "{}");
      const at = new Date(Date.now() - ageMs);
      utimesSync(join(dir, name), at, at);
    };
    folder(".partial-arbor.m.1-x-123-abc", 2 * 60 * 60_000);
    folder(".partial-arbor.m.2-x-123-def", 60_000);
    folder("arbor.m.1-x", 2 * 60 * 60_000);
    const adapters = new UpstreamAdapters({
      upstreams: {},
      dir,
      blobs: new MemoryBlobStore(),
      logger: pino({ level: "silent" }),
    });
    expect(await adapters.sweepPartial()).toEqual([".partial-arbor.m.1-x-123-abc"]);
    expect(readdirSync(dir).sort()).toEqual([".partial-arbor.m.2-x-123-def", "arbor.m.1-x"]);
  });
});
