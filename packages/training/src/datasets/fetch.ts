import type { LookupAddress } from "node:dns";
import { lookup as dnsLookup } from "node:dns/promises";
import { request as httpsRequest } from "node:https";
import { isIP, type LookupFunction } from "node:net";
import { Readable } from "node:stream";
import type { DpoPair, SftExample as EngineSftExample } from "@arbor/engine/train";
import { type Dataset, quote, type Store } from "@arbor/store";
import ipaddr from "ipaddr.js";
import { TrainingDataError } from "../errors.ts";
import {
  datasetExamples,
  datasetIdOf,
  datasetPairs,
  datasetText,
  findDataset,
} from "./datasets.ts";
import { dpoPairs, sftExamples } from "./jsonl.ts";

/**
 * Where `training_data_url` points (ADR 15): `dataset://<id>` (an upload of the same entity)
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
  /** `host[:port]` entries (hostnames or IP literals, IPv6 in brackets) that may resolve to
   * non-public addresses, on that port only (443 when none is given). Case-insensitive. */
  allowHosts?: readonly string[];
  lookup?: Lookup;
  transport?: Transport;
  /** Default 5. */
  maxRedirects?: number;
  /** For the whole fetch, body included. Default 60 s. */
  timeoutMs?: number;
}

const defaultLookup: Lookup = (hostname) => dnsLookup(hostname, { all: true, verbatim: true });

/** Fetches an `https://` JSONL file and returns its text. Each hop (redirects included) is
 * resolved once, checked, and connected to exactly the checked addresses, so a second DNS answer
 * cannot swap in a private address. Errors are TrainingDataErrors (invalid, too large), with
 * messages fit for a job's `error_message`. */
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
  const port = url.port || "443";
  const allowed = allowHosts.some((entry) => {
    const listed = allowedHost(entry);
    return listed !== undefined && listed.host === host && listed.port === port;
  });
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

/** The class of an IPv4 or IPv6 address, from ipaddr.js's special ranges. Forms that carry an
 * IPv4 address (IPv4-mapped, IPv4-translated, IPv4-compatible, NAT64's well-known prefix, 6to4)
 * are judged by that address; NAT64's local-use prefix and Teredo, which tunnel to addresses
 * that cannot be judged from here, are refused. Anything that does not parse is "reserved". */
export function classifyAddress(address: string): AddressClass {
  const bare = address.replace(/^\[|\]$/g, "").replace(/%.*$/, "");
  if (!ipaddr.isValid(bare)) return "reserved";
  const parsed = ipaddr.parse(bare);
  if (parsed.kind() === "ipv4") return classifyIPv4(parsed as ipaddr.IPv4);
  const v6 = parsed as ipaddr.IPv6;
  const bytes = v6.toByteArray();
  // A string: the typings leave out ranges the library has (deprecatedSiteLocal).
  const range: string = v6.range();
  switch (range) {
    case "unicast": {
      // ::a.b.c.d (IPv4-compatible, deprecated) is not a range of ipaddr.js's.
      const compatible = bytes.slice(0, 12).every((b) => b === 0);
      return compatible ? classifyIPv4(new ipaddr.IPv4(bytes.slice(12))) : "public";
    }
    case "ipv4Mapped":
    case "rfc6145":
      return classifyIPv4(new ipaddr.IPv4(bytes.slice(12)));
    case "rfc6052":
      // 64:ff9b::/96 carries the IPv4 address last; 64:ff9b:1::/48 is a network's own prefix.
      return bytes.slice(4, 12).every((b) => b === 0)
        ? classifyIPv4(new ipaddr.IPv4(bytes.slice(12)))
        : "reserved";
    case "6to4":
      return classifyIPv4(new ipaddr.IPv4(bytes.slice(2, 6)));
    case "unspecified":
    case "loopback":
    case "multicast":
      return range;
    case "linkLocal":
      return "link-local";
    case "uniqueLocal":
      return "unique-local";
    case "deprecatedSiteLocal":
      return "private";
    default:
      return "reserved";
  }
}

function classifyIPv4(address: ipaddr.IPv4): AddressClass {
  const range = address.range();
  switch (range) {
    case "unicast":
      return "public";
    case "unspecified":
    case "loopback":
    case "multicast":
    case "private":
      return range;
    case "carrierGradeNat":
      return "private";
    case "linkLocal":
      // Cloud metadata services live here.
      return "link-local";
    default:
      return "reserved";
  }
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

/** An allow-list entry as a host and port: `host`, `host:port`, `[v6]` or `[v6]:port`. */
function allowedHost(entry: string): { host: string; port: string } | undefined {
  try {
    const url = new URL(`https://${entry.trim()}`);
    return { host: hostOf(url), port: url.port || "443" };
  } catch {
    return undefined;
  }
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
  return new TrainingDataError("invalid", message, {
    code: "invalid_training_data_url",
    param: "training_data_url",
  });
}

function tooLarge(maxBytes: number): TrainingDataError {
  return new TrainingDataError("too_large", `Training data is over the ${maxBytes}-byte limit.`, {
    code: "request_too_large",
  });
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
 * dataset is not found (another entity's ids read as missing). */
export async function resolveDatasetUrl(
  store: Store,
  entity: string,
  url: string,
): Promise<string> {
  return datasetText(store, await datasetOfUrl(store, entity, url));
}

async function datasetOfUrl(store: Store, entity: string, url: string): Promise<Dataset> {
  const id = datasetIdOf(url);
  if (id === undefined) {
    throw badUrl(`Training data URL must look like dataset://<id>, got ${quote(url)}.`);
  }
  return findDataset(store, entity, id);
}

/** Either scheme of `training_data_url` to validated SFT examples: what the SFT worker trains
 * on. A `dataset://` file is read from the blob store line by line, never whole. */
export async function loadSftExamples(
  store: Store,
  entity: string,
  url: string,
  options: FetchTrainingDataOptions,
): Promise<EngineSftExample[]> {
  if (isDatasetUrl(url)) return datasetExamples(store, await datasetOfUrl(store, entity, url));
  return sftExamples(await fetchTrainingData(url, options));
}

/** `loadSftExamples` for a DPO job: validated preference pairs (ADR 69). */
export async function loadDpoPairs(
  store: Store,
  entity: string,
  url: string,
  options: FetchTrainingDataOptions,
): Promise<DpoPair[]> {
  if (isDatasetUrl(url)) return datasetPairs(store, await datasetOfUrl(store, entity, url));
  return dpoPairs(await fetchTrainingData(url, options));
}

const isDatasetUrl = (url: string) => url.trim().toLowerCase().startsWith("dataset://");

/** Either scheme of `training_data_url` to text: what the SFT worker calls before parsing. */
export async function loadTrainingData(
  store: Store,
  entity: string,
  url: string,
  options: FetchTrainingDataOptions,
): Promise<string> {
  if (isDatasetUrl(url)) {
    return resolveDatasetUrl(store, entity, url);
  }
  return fetchTrainingData(url, options);
}
