import { readFileSync } from "node:fs";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { readConfig, settingsTable, upstreamLoraDir } from "./settings.ts";

describe("readConfig", () => {
  it("when nothing is set, then every setting has its default", () => {
    const config = readConfig({});
    expect(config).toMatchObject({
      port: 8080,
      host: "127.0.0.1",
      roles: ["training", "inference", "calls"],
      embeddedWorker: true,
      trainingThreads: 1,
      workerLeaseMs: 15_000,
      trainingDataMaxBytes: 64 * 1024 * 1024,
      trainingDataAllowHosts: [],
      upstreams: {},
      keyRequestsPerMinute: undefined,
      databaseUrl: undefined,
      blobs: undefined,
      redisUrl: undefined,
      metrics: "key",
      uploadMemoryBytes: 1024 * 1024 * 1024,
    });
    expect(config.engineThreads).toBeGreaterThanOrEqual(1);
    expect(config.llamaModels.size).toBe(0);
  });

  it("when the Hub's endpoint and token are read, then they are read as huggingface_hub reads them", async () => {
    const home = await mkdtemp(join(tmpdir(), "arbor-hf-home-"));
    try {
      await writeFile(join(home, "token"), "hf_from_file\n");
      expect(readConfig({})).toMatchObject({
        hfEndpoint: "https://huggingface.co",
        hfToken: undefined,
      });
      expect(readConfig({ HF_ENDPOINT: "http://mirror:8080//", HF_HOME: home })).toMatchObject({
        hfEndpoint: "http://mirror:8080",
        hfToken: "hf_from_file",
      });
      expect(
        readConfig({ HF_TOKEN: " hf_env ", HUGGING_FACE_HUB_TOKEN: "hf_old", HF_HOME: home })
          .hfToken,
      ).toBe("hf_env");
      expect(readConfig({ HUGGING_FACE_HUB_TOKEN: "hf_old", HF_HOME: home }).hfToken).toBe(
        "hf_old",
      );
      expect(readConfig({ HF_TOKEN_PATH: join(home, "token") }).hfToken).toBe("hf_from_file");
      expect(readConfig({ XDG_CACHE_HOME: join(home, "none") }).hfToken).toBeUndefined();
      expect(() => readConfig({ HF_ENDPOINT: "huggingface.co" })).toThrow(
        /HF_ENDPOINT must be an http:\/\/ or https:\/\/ URL/,
      );
    } finally {
      await rm(home, { recursive: true, force: true });
    }
  });

  it("when the roles leave out training, then no embedded worker runs unless asked for", () => {
    expect(readConfig({ ARBOR_ROLES: "inference" }).embeddedWorker).toBe(false);
    expect(readConfig({ ARBOR_ROLES: "calls,training" }).embeddedWorker).toBe(true);
    expect(
      readConfig({ ARBOR_ROLES: "inference", ARBOR_EMBEDDED_WORKER: "on" }).embeddedWorker,
    ).toBe(true);
  });

  it("when settings are bad, then one error names every bad variable", () => {
    const attempt = () =>
      readConfig({
        ARBOR_PORT: "70000",
        ARBOR_WORKER_LEASE_MS: "0",
        // A typo must not lift the cap on downloaded training data (NaN would).
        ARBOR_TRAINING_DATA_MAX_BYTES: "64MB",
        ARBOR_ENGINE_THREADS: "two",
        ARBOR_ROLES: "training,sales",
        DATABASE_URL: "mysql://x",
        ARBOR_UPSTREAMS: "{not json",
        ARBOR_METRICS: "yes",
        ARBOR_BLOBS: "s3",
        ARBOR_REDIS_URL: "http://cache:6379",
        ARBOR_UPLOAD_MEMORY_BYTES: "1GB",
      });
    expect(attempt).toThrow(/ARBOR_PORT must be an integer from 0 to 65535, got "70000"/);
    for (const name of [
      "ARBOR_WORKER_LEASE_MS",
      "ARBOR_TRAINING_DATA_MAX_BYTES",
      "ARBOR_UPLOAD_MEMORY_BYTES",
      'ARBOR_ENGINE_THREADS must be an integer from 1 to 64, got "two"',
      'ARBOR_ROLES has unknown role "sales"',
      "DATABASE_URL must be a postgres:// URL",
      "ARBOR_UPSTREAMS is not valid JSON",
      'ARBOR_METRICS must be one of key, public, off, got "yes"',
      'ARBOR_BLOBS must be one of fs, postgres, got "s3"',
      "ARBOR_REDIS_URL must be a redis:// or rediss:// URL",
    ])
      expect(attempt).toThrow(name);
  });

  it("when lists and maps are given, then they are read as such", () => {
    const config = readConfig({
      ARBOR_TRAINING_DATA_ALLOW_HOSTS: " data.internal:8443, other ",
      ARBOR_UPSTREAMS: '{"big/model": {"url": "http://gpu:8000/v1", "apiKey": "k"}}',
      ARBOR_ROLES: "inference",
      ARBOR_KEY_RPM: "60",
      ARBOR_METRICS: " public ",
    });
    expect(config.trainingDataAllowHosts).toEqual(["data.internal:8443", "other"]);
    expect(config.upstreams).toEqual({ "big/model": { url: "http://gpu:8000/v1", apiKey: "k" } });
    expect(config.roles).toEqual(["inference"]);
    expect(config.keyRequestsPerMinute).toBe(60);
    expect(config.metrics).toBe("public");
  });
});

describe("ARBOR_UPSTREAMS and ARBOR_UPSTREAM_LORA_DIR", () => {
  it("when an upstream names how it sees the adapters' directory and how many it keeps, then both are read", () => {
    const config = readConfig({
      ARBOR_DATA_DIR: "/srv/arbor",
      ARBOR_UPSTREAM_LORA_DIR: " /mnt/shared/lora ",
      ARBOR_UPSTREAMS: JSON.stringify({
        "qwen/Qwen3-0.6B": { url: "http://gpu:8000/v1", loraDir: "/data/lora", maxLoras: 2 },
      }),
    });
    expect(config.upstreams).toEqual({
      "qwen/Qwen3-0.6B": { url: "http://gpu:8000/v1", loraDir: "/data/lora", maxLoras: 2 },
    });
    expect(upstreamLoraDir(config)).toBe("/mnt/shared/lora");
    expect(upstreamLoraDir(readConfig({ ARBOR_DATA_DIR: "/srv/arbor" }))).toBe(
      "/srv/arbor/upstream-lora",
    );
  });

  it("when loraDir, maxLoras or the directory are not usable, then each is named", () => {
    const upstream = (fields: object) =>
      readConfig({
        ARBOR_UPSTREAMS: JSON.stringify({ "a/b": { url: "http://gpu:8000/v1", ...fields } }),
      });
    expect(() => upstream({ loraDir: "lora" })).toThrow(
      'ARBOR_UPSTREAMS ["a/b"].loraDir must be an absolute path',
    );
    for (const maxLoras of [0, 1.5, "8", 5000]) {
      expect(() => upstream({ maxLoras })).toThrow(
        'ARBOR_UPSTREAMS ["a/b"].maxLoras must be an integer from 1 to 1024',
      );
    }
    expect(() => readConfig({ ARBOR_UPSTREAM_LORA_DIR: "relative/dir" })).toThrow(
      'ARBOR_UPSTREAM_LORA_DIR must be an absolute path, got "relative/dir"',
    );
  });
});

describe("ARBOR_BLOBS and ARBOR_REDIS_URL", () => {
  it("when blobs are asked for in PostgreSQL, then only with DATABASE_URL", () => {
    expect(() => readConfig({ ARBOR_BLOBS: "postgres" })).toThrow(
      "ARBOR_BLOBS=postgres needs DATABASE_URL",
    );
    const pg = "postgres://db/arbor";
    expect(readConfig({ ARBOR_BLOBS: " postgres ", DATABASE_URL: pg }).blobs).toBe("postgres");
    expect(readConfig({ ARBOR_BLOBS: "fs", DATABASE_URL: pg }).blobs).toBe("fs");
    expect(readConfig({ ARBOR_BLOBS: "fs" }).blobs).toBe("fs");
  });

  it("when a Redis URL is given, then it is kept as given", () => {
    expect(readConfig({ ARBOR_REDIS_URL: " redis://127.0.0.1:6379/2 " }).redisUrl).toBe(
      "redis://127.0.0.1:6379/2",
    );
    expect(readConfig({ ARBOR_REDIS_URL: "rediss://user:pw@cache:6380" }).redisUrl).toBe(
      "rediss://user:pw@cache:6380",
    );
  });
});

describe("ARBOR_LLAMA_MODELS", () => {
  it("when it maps model ids to GGUF paths, then each is checked", async () => {
    const dir = await mkdtemp(join(tmpdir(), "arbor-llama-cfg-"));
    const models = (value: string) => readConfig({ ARBOR_LLAMA_MODELS: value }).llamaModels;
    try {
      const gguf = join(dir, "m.gguf");
      await writeFile(gguf, Buffer.from("GGUF\u0003\u0000\u0000\u0000", "latin1"));
      const other = join(dir, "not.gguf");
      await writeFile(other, "hello");
      expect(readConfig({}).llamaModels).toEqual(new Map());
      expect(models(JSON.stringify({ "me/m": gguf }))).toEqual(new Map([["me/m", gguf]]));
      expect(() => models("{")).toThrow(/ARBOR_LLAMA_MODELS is not valid JSON/);
      expect(() => models('["a"]')).toThrow(/JSON object/);
      expect(() => models(JSON.stringify({ a: join(dir, "missing.gguf") }))).toThrow(
        /missing\.gguf does not exist/,
      );
      expect(() => models(JSON.stringify({ a: other }))).toThrow(/is not a GGUF file/);
      expect(() => models(JSON.stringify({ a: 1 }))).toThrow(/non-empty string/);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe("settingsTable", () => {
  it("when the README lists the settings, then it is exactly this table (regenerate it from settingsTable())", () => {
    const readme = readFileSync(new URL("../../../README.md", import.meta.url), "utf8");
    expect(readme).toContain(settingsTable());
  });
});
