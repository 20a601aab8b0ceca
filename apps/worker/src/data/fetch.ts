import type { LookupAddress } from "node:dns";
import { lookup as dnsLookup } from "node:dns/promises";
import { request as httpsRequest } from "node:https";
import { isIP, type LookupFunction } from "node:net";
import { Readable } from "node:stream";
import type { Store } from "@arbor/store";

/**
 * Where `training_data_url` points (CONTRACT §5): `dataset://<id>` (an upload of the same entity)
 * or `https://`, fetched with a size cap and refused for loopback, private, link-local and
 * unique-local addresses unless the host is allow-listed.
 */

export type AddressClass =
  | "public"
  | "unspecified"
  | "loopback"
  | "private"
  | "link-local"
  | "unique-local"
  | "multicast"
  | "reserved";

/** Resolves a hostname to all its addresses (node:dns/promises `lookup` with `all: true`). */
export type Lookup = (hostname: string) => Promise<LookupAddress[]>;

/** Sends one GET to a vetted address and answers without following redirects. Injectable so the
 * redirect and cap logic can be tested without TLS or a network. */
export type Transport = (
  url: URL,
  addresses: LookupAddress[],
  signal: AbortSignal,
) => Promise<Response>;

export interface FetchTrainingDataOptions {
  /** The cap on the body; past it the fetch stops with a 413. */
  maxBytes: number;
  /** Hostnames (or IP literals) that may resolve to non-public addresses. Case-insensitive. */
  allowHosts?: readonly string[];
  lookup?: Lookup;
  transport?: Transport;
  /** Default 5. */
  maxRedirects?: number;
  /** For the whole fetch, body included. Default 60 s. */
  timeoutMs?: number;
}

/** Why training data cannot be had, with the HTTP status it means to an API caller. */
export class TrainingDataError extends Error {
  override name = "TrainingDataError";
  readonly status: number;
  readonly code: string;
  readonly param: string | null;
  constructor(status: number, message: string, code: string, param: string | null = null) {
    super(message);
    this.status = status;
    this.code = code;
    this.param = param;
  }
}

const defaultLookup: Lookup = (hostname) => dnsLookup(hostname, { all: true, verbatim: true });

/** Fetches an `https://` JSONL file and returns its text. Each hop (redirects included) is
 * resolved once, checked, and connected to exactly the checked addresses, so a second DNS answer
 * cannot swap in a private address. Errors are TrainingDataErrors (400, 413), with messages fit for a
 * job's `error_message`. */
export async function fetchTrainingData(
  url: string,
  options: FetchTrainingDataOptions,
): Promise<string> {
  const lookup = options.lookup ?? defaultLookup;
  const transport = options.transport ?? httpsTransport;
  const maxRedirects = options.maxRedirects ?? 5;
  const signal = AbortSignal.timeout(options.timeoutMs ?? 60_000);
  let current = parseHttpsUrl(url);
  try {
    for (let hop = 0; ; hop++) {
      const addresses = await vetHost(current, options.allowHosts ?? [], lookup);
      const response = await transport(current, addresses, signal);
      if (response.status >= 300 && response.status < 400 && response.headers.has("location")) {
        await response.body?.cancel().catch(() => {});
        if (hop >= maxRedirects)
          throw badUrl(`Training data URL: more than ${maxRedirects} redirects.`);
        current = parseHttpsUrl(new URL(response.headers.get("location")!, current).href, true);
        continue;
      }
      if (!response.ok) {
        await response.body?.cancel().catch(() => {});
        throw badUrl(`Training data URL answered HTTP ${response.status}: ${redact(current)}.`);
      }
      return await readBodyCapped(response, options.maxBytes);
    }
  } catch (err) {
    if (err instanceof TrainingDataError) throw err;
    if (signal.aborted) throw badUrl(`Training data URL timed out: ${redact(current)}.`);
    throw badUrl(`Training data URL could not be fetched: ${redact(current)}.`);
  }
}

/** Reads a body as UTF-8 text, never holding more than `maxBytes`: a larger Content-Length is
 * refused before reading, and a stream that runs past the cap is cancelled at once. */
export async function readBodyCapped(response: Response, maxBytes: number): Promise<string> {
  const declared = Number(response.headers.get("content-length"));
  if (Number.isFinite(declared) && declared > maxBytes) {
    await response.body?.cancel().catch(() => {});
    throw tooLarge(maxBytes);
  }
  if (!response.body) return "";
  const reader = response.body.getReader();
  const chunks: Uint8Array[] = [];
  let total = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    total += value.byteLength;
    if (total > maxBytes) {
      await reader.cancel().catch(() => {});
      throw tooLarge(maxBytes);
    }
    chunks.push(value);
  }
  try {
    return new TextDecoder("utf-8", { fatal: true, ignoreBOM: false }).decode(
      Buffer.concat(chunks, total),
    );
  } catch {
    throw badUrl("Training data is not valid UTF-8.");
  }
}

/** Resolves the URL's host and refuses it unless every address is public or the host is
 * allow-listed. Returns the addresses to connect to. */
export async function vetHost(
  url: URL,
  allowHosts: readonly string[],
  lookup: Lookup = defaultLookup,
): Promise<LookupAddress[]> {
  const host = hostOf(url);
  const allowed = allowHosts.some((h) => normalizeHost(h) === host);
  let addresses: LookupAddress[];
  const family = isIP(host);
  if (family !== 0) {
    addresses = [{ address: host, family }];
  } else {
    try {
      addresses = await lookup(host);
    } catch {
      throw badUrl(`Training data URL: host "${host}" could not be resolved.`);
    }
    if (addresses.length === 0) {
      throw badUrl(`Training data URL: host "${host}" could not be resolved.`);
    }
  }
  if (!allowed) {
    for (const { address } of addresses) {
      const kind = classifyAddress(address);
      if (kind !== "public") {
        throw badUrl(
          `Training data URL: host "${host}" resolves to a ${kind} address (${address}), which is refused unless the host is allow-listed.`,
        );
      }
    }
  }
  return addresses;
}

/** The class of an IPv4 or IPv6 address (IPv4-mapped, NAT64 and 6to4 forms are judged by the
 * IPv4 address they carry). Anything that does not parse is "reserved". */
export function classifyAddress(address: string): AddressClass {
  const bare = address.replace(/^\[|\]$/g, "").replace(/%.*$/, "");
  const v4 = parseIPv4(bare);
  if (v4) return classifyIPv4(v4);
  const v6 = parseIPv6(bare);
  if (!v6) return "reserved";
  return classifyIPv6(v6);
}

function classifyIPv4([a, b, c]: number[]): AddressClass {
  if (a === 0) return "unspecified"; // 0.0.0.0/8, "this network"
  if (a === 127) return "loopback";
  if (a === 10) return "private";
  if (a === 172 && b! >= 16 && b! <= 31) return "private";
  if (a === 192 && b === 168) return "private";
  if (a === 100 && b! >= 64 && b! <= 127) return "private"; // carrier-grade NAT, 100.64/10
  if (a === 169 && b === 254) return "link-local"; // cloud metadata lives here
  if (a === 192 && b === 0 && c === 0) return "reserved"; // IETF protocol assignments
  if (a === 192 && b === 0 && c === 2) return "reserved"; // TEST-NET-1
  if (a === 198 && (b === 18 || b === 19)) return "reserved"; // benchmarking
  if (a === 198 && b === 51 && c === 100) return "reserved"; // TEST-NET-2
  if (a === 203 && b === 0 && c === 113) return "reserved"; // TEST-NET-3
  if (a! >= 224 && a! <= 239) return "multicast";
  if (a! >= 240) return "reserved"; // 240/4 and the broadcast address
  return "public";
}

function classifyIPv6(bytes: number[]): AddressClass {
  const zeroUpTo = (n: number) => bytes.slice(0, n).every((b) => b === 0);
  if (zeroUpTo(16)) return "unspecified";
  if (zeroUpTo(15) && bytes[15] === 1) return "loopback";
  // ::ffff:a.b.c.d (IPv4-mapped) and ::a.b.c.d (IPv4-compatible, deprecated).
  if (zeroUpTo(10) && bytes[10] === 0xff && bytes[11] === 0xff) {
    return classifyIPv4(bytes.slice(12));
  }
  if (zeroUpTo(12)) return classifyIPv4(bytes.slice(12));
  // 64:ff9b::/96, the NAT64 well-known prefix, carries an IPv4 address.
  if (
    bytes[0] === 0 &&
    bytes[1] === 0x64 &&
    bytes[2] === 0xff &&
    bytes[3] === 0x9b &&
    bytes.slice(4, 12).every((b) => b === 0)
  ) {
    return classifyIPv4(bytes.slice(12));
  }
  // 2002::/16 (6to4) carries an IPv4 address in bytes 2..5.
  if (bytes[0] === 0x20 && bytes[1] === 0x02) {
    const inner = classifyIPv4(bytes.slice(2, 6));
    if (inner !== "public") return inner;
  }
  const first = bytes[0]!;
  const second = bytes[1]!;
  if ((first & 0xfe) === 0xfc) return "unique-local"; // fc00::/7
  if (first === 0xfe && (second & 0xc0) === 0x80) return "link-local"; // fe80::/10
  if (first === 0xfe && (second & 0xc0) === 0xc0) return "private"; // fec0::/10, site-local
  if (first === 0xff) return "multicast";
  if (first === 0x01 && second === 0 && zeroUpTo(8)) return "reserved"; // 100::/64, discard
  if (first === 0x20 && second === 0x01 && bytes[2] === 0x0d && bytes[3] === 0xb8) {
    return "reserved"; // 2001:db8::/32, documentation
  }
  return "public";
}

function parseIPv4(text: string): number[] | undefined {
  const parts = text.split(".");
  if (parts.length !== 4) return undefined;
  const bytes = parts.map((p) => (/^\d{1,3}$/.test(p) ? Number(p) : Number.NaN));
  return bytes.every((b) => b >= 0 && b <= 255) ? bytes : undefined;
}

/** Sixteen bytes, or undefined. Accepts `::` and a dotted IPv4 tail. */
function parseIPv6(text: string): number[] | undefined {
  if (isIP(text) !== 6) return undefined;
  let head = text;
  const tail: number[] = [];
  const lastColon = text.lastIndexOf(":");
  if (text.slice(lastColon + 1).includes(".")) {
    const v4 = parseIPv4(text.slice(lastColon + 1));
    if (!v4) return undefined;
    tail.push((v4[0]! << 8) | v4[1]!, (v4[2]! << 8) | v4[3]!);
    head = text.slice(0, lastColon + 1);
    if (head.endsWith(":") && !head.endsWith("::")) head = head.slice(0, -1);
  }
  const groupsOf = (s: string) => (s === "" ? [] : s.split(":").map((g) => Number.parseInt(g, 16)));
  let groups: number[];
  const gap = head.indexOf("::");
  if (gap >= 0) {
    const left = groupsOf(head.slice(0, gap));
    const right = [...groupsOf(head.slice(gap + 2)), ...tail];
    const fill = 8 - left.length - right.length;
    if (fill < 0) return undefined;
    groups = [...left, ...new Array<number>(fill).fill(0), ...right];
  } else {
    groups = [...groupsOf(head), ...tail];
  }
  if (groups.length !== 8 || groups.some((g) => !(g >= 0 && g <= 0xffff))) return undefined;
  return groups.flatMap((g) => [g >> 8, g & 0xff]);
}

function parseHttpsUrl(raw: string, redirected = false): URL {
  let url: URL;
  try {
    url = new URL(raw);
  } catch {
    throw badUrl(`Training data URL is not a valid URL.`);
  }
  if (url.protocol !== "https:") {
    throw badUrl(
      redirected
        ? `Training data URL redirected to a ${url.protocol.replace(/:$/, "")} URL; only https is followed.`
        : `Training data URL must be https:// or dataset://<id>, got "${url.protocol}".`,
    );
  }
  if (url.username || url.password) throw badUrl("Training data URL must not carry credentials.");
  return url;
}

function hostOf(url: URL): string {
  return normalizeHost(url.hostname);
}

function normalizeHost(host: string): string {
  return host
    .trim()
    .toLowerCase()
    .replace(/^\[|\]$/g, "")
    .replace(/\.$/, "");
}

/** The URL without its query (which may carry a signature) for messages. */
function redact(url: URL): string {
  return `${url.origin}${url.pathname}`;
}

function badUrl(message: string): TrainingDataError {
  return new TrainingDataError(400, message, "invalid_training_data_url", "training_data_url");
}

function tooLarge(maxBytes: number): TrainingDataError {
  return new TrainingDataError(
    413,
    `Training data is over the ${maxBytes}-byte limit.`,
    "request_too_large",
  );
}

/** node:https with a `lookup` that answers only the vetted addresses (no second DNS query). */
const httpsTransport: Transport = (url, addresses, signal) =>
  new Promise<Response>((resolve, reject) => {
    const pinned: LookupFunction = (_hostname, options, callback) => {
      const cb = callback as (
        err: Error | null,
        address: string | LookupAddress[],
        family?: number,
      ) => void;
      if ((options as { all?: boolean }).all) cb(null, addresses);
      else cb(null, addresses[0]!.address, addresses[0]!.family);
    };
    const req = httpsRequest(
      url,
      { method: "GET", lookup: pinned, signal, headers: { accept: "application/jsonl, */*" } },
      (res) => {
        const headers = new Headers();
        for (const [name, value] of Object.entries(res.headers)) {
          if (value === undefined) continue;
          for (const v of Array.isArray(value) ? value : [value]) headers.append(name, v);
        }
        const status = res.statusCode ?? 502;
        const nullBody = status === 204 || status === 304;
        if (nullBody) res.resume();
        resolve(
          new Response(
            nullBody ? null : (Readable.toWeb(res) as unknown as ReadableStream<Uint8Array>),
            { status, headers },
          ),
        );
      },
    );
    req.on("error", reject);
    req.end();
  });

/** The stored text of one of `entity`'s datasets, for `dataset://<id>`. A missing or foreign
 * dataset is a 404 (another entity's ids read as missing). */
export async function resolveDatasetUrl(
  store: Store,
  entity: string,
  url: string,
): Promise<string> {
  const id = datasetIdOf(url);
  if (id === undefined) {
    throw badUrl(`Training data URL must look like dataset://<id>, got "${url}".`);
  }
  const dataset = await store.datasets.get(entity, id);
  if (!dataset)
    throw new TrainingDataError(
      404,
      `No dataset "${id}" in entity "${entity}".`,
      "dataset_not_found",
    );
  if (!store.blobs) throw new Error("The store has no blob directory; datasets need one.");
  const blob = await store.blobs.get(dataset.blob_key);
  if (!blob) throw new Error(`Dataset ${id} has a row but no blob at ${dataset.blob_key}.`);
  return blob.toString("utf8");
}

/** `dataset://<id>` → `<id>`; anything else → undefined. */
export function datasetIdOf(url: string): string | undefined {
  const match = /^dataset:\/\/([0-9a-fA-F-]{36})\/?$/.exec(url.trim());
  return match?.[1]?.toLowerCase();
}

/** Either scheme of `training_data_url` to text: what the SFT worker calls before parsing. */
export async function loadTrainingData(
  store: Store,
  entity: string,
  url: string,
  options: FetchTrainingDataOptions,
): Promise<string> {
  if (url.trim().toLowerCase().startsWith("dataset://")) {
    return resolveDatasetUrl(store, entity, url);
  }
  return fetchTrainingData(url, options);
}
