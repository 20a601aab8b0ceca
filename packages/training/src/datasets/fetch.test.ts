import type { LookupAddress } from "node:dns";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { DomainError, openStore } from "@arbor/store";
import { describe, expect, it, vi } from "vitest";
import { datasetIdOf } from "./datasets.ts";
import {
  type AddressClass,
  classifyAddress,
  fetchTrainingData,
  loadSftExamples,
  loadTrainingData,
  readBodyCapped,
  resolveDatasetUrl,
  type Transport,
} from "./fetch.ts";
import { DatasetLineError, sftExamples } from "./jsonl.ts";

async function refusal(promise: Promise<unknown>): Promise<DomainError> {
  try {
    await promise;
  } catch (err) {
    if (err instanceof DomainError) return err;
    throw err;
  }
  throw new Error("expected a DomainError");
}

const resolvesTo =
  (...addresses: string[]) =>
  async (_host: string): Promise<LookupAddress[]> =>
    addresses.map((address) => ({ address, family: address.includes(":") ? 6 : 4 }));

/** A body streamed in chunks, counting how many chunks were pulled. */
function chunked(chunks: number, size: number, headers: Record<string, string> = {}) {
  let pulled = 0;
  const stream = new ReadableStream<Uint8Array>({
    pull(controller) {
      if (pulled === chunks) return controller.close();
      pulled++;
      controller.enqueue(new Uint8Array(size).fill(0x61));
    },
  });
  return { response: new Response(stream, { headers }), pulled: () => pulled };
}

describe("classifyAddress", () => {
  const cases: [string, AddressClass][] = [
    ["8.8.8.8", "public"],
    ["1.1.1.1", "public"],
    ["172.32.0.1", "public"],
    ["100.128.0.1", "public"],
    ["0.0.0.0", "unspecified"],
    ["127.0.0.1", "loopback"],
    ["127.255.255.254", "loopback"],
    ["10.1.2.3", "private"],
    ["172.16.0.1", "private"],
    ["172.31.255.255", "private"],
    ["192.168.1.1", "private"],
    ["100.64.0.1", "private"],
    ["169.254.169.254", "link-local"],
    ["224.0.0.1", "multicast"],
    ["255.255.255.255", "reserved"],
    ["192.0.2.1", "reserved"],
    ["2606:4700:4700::1111", "public"],
    ["2001:4860:4860::8888", "public"],
    ["::", "unspecified"],
    ["::1", "loopback"],
    ["0:0:0:0:0:0:0:1", "loopback"],
    ["[::1]", "loopback"],
    ["fe80::1", "link-local"],
    ["fe80::1%eth0", "link-local"],
    ["febf::1", "link-local"],
    ["fec0::1", "private"],
    ["fc00::1", "unique-local"],
    ["fd12:3456:789a::1", "unique-local"],
    ["ff02::1", "multicast"],
    ["::ffff:127.0.0.1", "loopback"],
    ["::ffff:7f00:1", "loopback"],
    ["::FFFF:10.0.0.1", "private"],
    ["::ffff:169.254.169.254", "link-local"],
    ["::ffff:8.8.8.8", "public"],
    ["0:0:0:0:0:ffff:192.168.0.1", "private"],
    ["::127.0.0.1", "loopback"],
    ["64:ff9b::10.0.0.1", "private"],
    ["64:ff9b::8.8.8.8", "public"],
    ["2002:7f00:1::", "loopback"],
    ["2001:db8::1", "reserved"],
    ["::ffff:0:7f00:1", "loopback"],
    ["::ffff:0:a00:1", "private"],
    ["64:ff9b:1::7f00:1", "reserved"],
    ["64:ff9b::7f00:1", "loopback"],
    ["2001:0:4136:e378:8000:63bf:3fff:fdd2", "reserved"],
    ["100.100.100.200", "private"],
    ["not-an-ip", "reserved"],
  ];
  it.each(cases)("when the address is %s, then it is %s", (address, kind) => {
    expect(classifyAddress(address)).toBe(kind);
  });
});

describe("fetchTrainingData", () => {
  const neverCalled: Transport = () => {
    throw new Error("the transport must not be reached");
  };

  it.each(["http://example.com/train.jsonl", "ftp://example.com/x", "file:///etc/passwd", "nope"])(
    "when the URL is %s, then it is refused before any lookup",
    async (url) => {
      const err = await refusal(
        fetchTrainingData(url, {
          maxBytes: 100,
          lookup: () => Promise.reject(new Error("no lookup expected")),
          transport: neverCalled,
        }),
      );
      expect(err.kind).toBe("invalid");
      expect(err.code).toBe("invalid_training_data_url");
      expect(err.param).toBe("training_data_url");
    },
  );

  it.each([
    ["127.0.0.1", "loopback"],
    ["10.0.0.5", "private"],
    ["169.254.169.254", "link-local"],
    ["fd00::1", "unique-local"],
    ["::ffff:192.168.0.10", "private"],
  ])("when the host resolves to %s, then it is refused as %s", async (address, kind) => {
    const err = await refusal(
      fetchTrainingData("https://data.example.com/train.jsonl", {
        maxBytes: 100,
        lookup: resolvesTo(address),
        transport: neverCalled,
      }),
    );
    expect(err.kind).toBe("invalid");
    expect(err.message).toBe(
      `Training data URL: host "data.example.com" resolves to a ${kind} address (${address}), which is refused unless the host is allow-listed.`,
    );
  });

  it("when any one of several addresses is private, then the host is refused", async () => {
    const err = await refusal(
      fetchTrainingData("https://data.example.com/x", {
        maxBytes: 100,
        lookup: resolvesTo("8.8.8.8", "2606:4700::1", "10.0.0.1"),
        transport: neverCalled,
      }),
    );
    expect(err.message).toContain("private address (10.0.0.1)");
  });

  it.each(["https://127.0.0.1/x", "https://[::1]/x", "https://[::ffff:10.0.0.1]/x"])(
    "when the URL names a private address literally (%s), then it is refused without a lookup",
    async (url) => {
      const err = await refusal(
        fetchTrainingData(url, {
          maxBytes: 100,
          lookup: () => Promise.reject(new Error("no lookup expected")),
          transport: neverCalled,
        }),
      );
      expect(err.kind).toBe("invalid");
      expect(err.message).toMatch(/resolves to a (loopback|private) address/);
    },
  );

  it("when the host cannot be resolved, then 400", async () => {
    const err = await refusal(
      fetchTrainingData("https://nowhere.invalid/x", {
        maxBytes: 100,
        lookup: () => Promise.reject(new Error("ENOTFOUND")),
        transport: neverCalled,
      }),
    );
    expect(err.message).toBe('Training data URL: host "nowhere.invalid" could not be resolved.');
  });

  it("when a private host is allow-listed, then it is fetched from exactly the checked addresses", async () => {
    const seen: { url: string; addresses: LookupAddress[] }[] = [];
    const text = await fetchTrainingData("https://Data.Internal./train.jsonl?sig=1", {
      maxBytes: 100,
      allowHosts: ["data.internal"],
      lookup: resolvesTo("10.0.0.7"),
      transport: async (url, addresses) => {
        seen.push({ url: url.href, addresses });
        return new Response('{"messages": []}\n');
      },
    });
    expect(text).toBe('{"messages": []}\n');
    expect(seen).toEqual([
      {
        url: "https://data.internal./train.jsonl?sig=1",
        addresses: [{ address: "10.0.0.7", family: 4 }],
      },
    ]);
  });

  it.each([
    ["data.internal", "https://data.internal:8443/t.jsonl", false],
    ["data.internal", "https://data.internal:443/t.jsonl", true],
    ["data.internal:8443", "https://data.internal:8443/t.jsonl", true],
    ["data.internal:8443", "https://data.internal/t.jsonl", false],
    ["[fd00::7]:8443", "https://[fd00::7]:8443/t.jsonl", true],
  ])("when %s is allow-listed, then %s is allowed: %s", async (entry, url, allowed) => {
    const fetched = fetchTrainingData(url, {
      maxBytes: 100,
      allowHosts: [entry],
      lookup: resolvesTo("10.0.0.7"),
      transport: async () => new Response("{}\n"),
    });
    if (allowed) expect(await fetched).toBe("{}\n");
    else
      expect((await refusal(fetched)).message).toMatch(/refused unless the host is allow-listed/);
  });

  it("when a public host redirects to a private one, then the hop is re-checked and refused", async () => {
    const hosts: Record<string, string> = {
      "public.example": "8.8.8.8",
      "inner.example": "10.1.1.1",
    };
    const hops: string[] = [];
    const err = await refusal(
      fetchTrainingData("https://public.example/a", {
        maxBytes: 100,
        lookup: async (host) => [{ address: hosts[host]!, family: 4 }],
        transport: async (url) => {
          hops.push(url.href);
          return new Response(null, {
            status: 302,
            headers: { location: "https://inner.example/b" },
          });
        },
      }),
    );
    expect(hops).toEqual(["https://public.example/a"]);
    expect(err.message).toContain('host "inner.example" resolves to a private address');
  });

  it("when a redirect leaves https, then it is refused", async () => {
    const err = await refusal(
      fetchTrainingData("https://public.example/a", {
        maxBytes: 100,
        lookup: resolvesTo("8.8.8.8"),
        transport: async () =>
          new Response(null, { status: 301, headers: { location: "http://public.example/b" } }),
      }),
    );
    expect(err.message).toBe("Training data URL redirected to a http URL; only https is followed.");
  });

  it("when redirects stay public, then they are followed (relative ones too) up to the limit", async () => {
    let n = 0;
    const text = await fetchTrainingData("https://public.example/a", {
      maxBytes: 100,
      lookup: resolvesTo("8.8.8.8"),
      transport: async (url) =>
        ++n < 3
          ? new Response(null, { status: 307, headers: { location: `/hop${n}` } })
          : new Response(`at ${url.pathname}`),
    });
    expect(text).toBe("at /hop2");
    const loop = await refusal(
      fetchTrainingData("https://public.example/a", {
        maxBytes: 100,
        maxRedirects: 2,
        lookup: resolvesTo("8.8.8.8"),
        transport: async () => new Response(null, { status: 302, headers: { location: "/again" } }),
      }),
    );
    expect(loop.message).toBe("Training data URL: more than 2 redirects.");
  });

  it("when the server answers an error status, then 400 without the query string", async () => {
    const err = await refusal(
      fetchTrainingData("https://public.example/a.jsonl?token=secret", {
        maxBytes: 100,
        lookup: resolvesTo("8.8.8.8"),
        transport: async () => new Response("nope", { status: 403 }),
      }),
    );
    expect(err.message).toBe(
      "Training data URL answered HTTP 403: https://public.example/a.jsonl.",
    );
  });

  it("when the body is over the cap, then 413 request_too_large", async () => {
    const err = await refusal(
      fetchTrainingData("https://public.example/a", {
        maxBytes: 10,
        lookup: resolvesTo("8.8.8.8"),
        transport: async () => chunked(4, 4).response,
      }),
    );
    expect(err.kind).toBe("too_large");
    expect(err.code).toBe("request_too_large");
  });
});

describe("readBodyCapped", () => {
  it("when the body is exactly the cap, then it is read whole", async () => {
    const { response } = chunked(4, 25);
    expect(await readBodyCapped(response, 100)).toBe("a".repeat(100));
  });

  it("when the stream runs past the cap, then reading stops at the chunk that crosses it", async () => {
    const { response, pulled } = chunked(1000, 64);
    const err = await refusal(readBodyCapped(response, 200));
    expect(err.kind).toBe("too_large");
    expect(err.message).toBe("Training data is over the 200-byte limit.");
    // 4 chunks of 64 cross 200; the stream's one read-ahead may pull a fifth, never the rest.
    expect(pulled()).toBeLessThanOrEqual(5);
  });

  it("when Content-Length declares more than the cap, then nothing is read", async () => {
    const { response, pulled } = chunked(1000, 64, { "content-length": "64000" });
    const err = await refusal(readBodyCapped(response, 1000));
    expect(err.kind).toBe("too_large");
    expect(pulled()).toBeLessThanOrEqual(1);
  });

  it("when the body is not UTF-8, then 400", async () => {
    const err = await refusal(readBodyCapped(new Response(new Uint8Array([0xff, 0xfe, 0x00])), 10));
    expect(err.kind).toBe("invalid");
    expect(err.message).toBe("Training data is not valid UTF-8.");
  });
});

describe("resolveDatasetUrl", () => {
  it("when the dataset is the entity's, then its stored text is returned; another entity's reads as missing", async () => {
    const dir = mkdtempSync(join(tmpdir(), "arbor-datasets-"));
    const store = await openStore({ dataDir: dir });
    try {
      await store.entities.ensure("acme");
      await store.entities.ensure("other");
      const text = '{"messages": [{"role": "assistant", "content": "x"}]}\n';
      await store.blobs.put("datasets/acme.jsonl", Buffer.from(text));
      const created = await store.datasets.create({
        entity: "acme",
        name: null,
        blob_key: "datasets/acme.jsonl",
        bytes: text.length,
        lines: 1,
      });
      const dataset = { url: `dataset://${created.id}` };
      expect(await resolveDatasetUrl(store, "acme", dataset.url)).toBe(text);
      expect(await loadTrainingData(store, "acme", dataset.url, { maxBytes: 10 })).toBe(text);

      const foreign = await refusal(resolveDatasetUrl(store, "other", dataset.url));
      expect(foreign.kind).toBe("not_found");
      expect(foreign.code).toBe("dataset_not_found");
      const missing = await refusal(
        resolveDatasetUrl(store, "acme", "dataset://0193a0b3-f0e1-7d2c-ab3c-4d5e6f708192"),
      );
      expect(missing.kind).toBe("not_found");
      const malformed = await refusal(resolveDatasetUrl(store, "acme", "dataset://x"));
      expect(malformed.kind).toBe("invalid");
    } finally {
      await store.close();
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("when a job loads a dataset, then it is streamed line by line (never read whole) into the same examples and errors", async () => {
    const dir = mkdtempSync(join(tmpdir(), "arbor-datasets-"));
    const store = await openStore({ dataDir: dir });
    try {
      await store.entities.ensure("acme");
      const line = (i: number) =>
        JSON.stringify({
          messages: [
            { role: "user", content: `Wie viel ist ${i} + ${i}? ✓ ${"é".repeat(i % 50)}` },
            { role: "assistant", content: `${2 * i} 😀` },
          ],
        });
      // Several of the file stream's 64 KiB chunks, lines and characters cut across them.
      const lines = Array.from({ length: 2000 }, (_, i) => line(i));
      const text = `\ufeff${lines.join("\r\n")}\n\n`;
      const add = async (key: string, body: string) => {
        await store.blobs.put(key, body);
        const dataset = await store.datasets.create({
          entity: "acme",
          name: null,
          blob_key: key,
          bytes: Buffer.byteLength(body),
          lines: 1,
        });
        return `dataset://${dataset.id}`;
      };
      const get = vi.spyOn(store.blobs, "get");
      const url = await add("datasets/big.jsonl", text);
      const examples = await loadSftExamples(store, "acme", url, { maxBytes: 10 });
      expect(examples).toEqual(sftExamples(text));
      expect(examples).toHaveLength(2000);
      expect(get).not.toHaveBeenCalled();

      const bad = await add(
        "datasets/bad.jsonl",
        `${lines.slice(0, 1500).join("\n")}\n{"messages": 1}\n`,
      );
      const error = await refusal(loadSftExamples(store, "acme", bad, { maxBytes: 10 }));
      expect(error).toBeInstanceOf(DatasetLineError);
      expect(error.message).toMatch(/^Line 1501: /);
      const empty = await add("datasets/empty.jsonl", "\n \n");
      expect((await refusal(loadSftExamples(store, "acme", empty, { maxBytes: 10 }))).message).toBe(
        "The dataset is empty: no JSONL lines.",
      );
      const missing = "dataset://0193a0b3-f0e1-7d2c-ab3c-4d5e6f708192";
      expect((await refusal(loadSftExamples(store, "acme", missing, { maxBytes: 10 }))).kind).toBe(
        "not_found",
      );
    } finally {
      await store.close();
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("when the URL is parsed, then only dataset://<uuid> yields an id", () => {
    expect(datasetIdOf("dataset://0193A0B3-F0E1-7D2C-AB3C-4D5E6F708192")).toBe(
      "0193a0b3-f0e1-7d2c-ab3c-4d5e6f708192",
    );
    expect(datasetIdOf("dataset://../etc")).toBeUndefined();
    expect(datasetIdOf("https://x/y")).toBeUndefined();
  });
});
