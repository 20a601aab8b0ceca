import { createHash } from "node:crypto";
import { readdirSync, readFileSync } from "node:fs";
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { join } from "node:path";
import { catalogModelDir } from "../src/model/catalog.ts";

/**
 * A stand-in for the Hugging Face Hub's HTTP API, as `huggingface_hub` and `@huggingface/hub`
 * read it (no Hub is reachable from the machines that test Arbor). Two servers on port 0: the
 * Hub, and the CDN its LFS downloads redirect to (another port: another origin).
 *
 * - `GET /api/models/{owner}/{name}/revision/{revision}`: `{id, sha, private, gated, siblings}`,
 *   each sibling `{rfilename}`, and with `?blobs=true` also `size`, `blobId` (the git blob
 *   SHA-1) and, for an LFS file, `lfs: {sha256, size, pointerSize}`. A revision is a branch or
 *   tag (percent-encoded, so `refs/pr/1` is one segment) or a full commit id. The listing of a
 *   gated repo is public, as the Hub's is.
 * - `GET|HEAD /{owner}/{name}/resolve/{revision}/{path}`: a file kept in git answers 200 with
 *   its bytes, `ETag: "<blob id>"`, `X-Repo-Commit` and `Accept-Ranges` (Range honoured, 206);
 *   an LFS file answers 302 to the CDN with `X-Repo-Commit`, `X-Linked-Etag: "<sha256>"` and
 *   `X-Linked-Size`, the CDN serving it with Range.
 * - Errors carry `X-Error-Code` and `X-Error-Message` as the Hub's do: an unknown repo 401
 *   `RepoNotFound`, an unknown revision 404 `RevisionNotFound`, an unknown file 404
 *   `EntryNotFound`; a gated repo without a token 401 `GatedRepo`, with a token that was not
 *   granted access 403 `GatedRepo`; a token it does not know 401 "Invalid credentials in
 *   Authorization header".
 * - A renamed repo's old id answers every request with a relative 307 to the same path under
 *   its new id (the redirect huggingface_hub follows without leaving the Hub).
 * - The CDN answers only signed URLs (the query the Hub's redirect carries) and, as S3 does, 400
 *   to a request that also carries an `Authorization` header (the client must not send the Hub
 *   token there); every such request is recorded.
 *
 * Faults for tests: a file's answers can be cut off (the socket destroyed) after some bytes, a
 * number of times; a file's SHA-256 can be announced wrong (in the listing and the headers).
 * Every request and the body bytes sent for each file are recorded.
 */

export interface StandinRepo {
  /** `owner/name`. */
  id: string;
  /** Branch or tag → the files at its commit. `main` is the default branch. */
  refs: Record<string, Record<string, Uint8Array | string>>;
  /** Which files are LFS; default: safetensors, pickles and anything over 10 MB. */
  lfs?: (path: string) => boolean;
  /** Gated: only tokens granted it (`tokens` of the stand-in) may download its files. */
  gated?: boolean;
}

export interface HubRequest {
  server: "hub" | "cdn";
  method: string;
  url: string;
  /** The repo file it is for (`owner/name/path`), when it is one. */
  file?: string;
  range?: string;
  authorization?: string;
  status?: number;
}

export interface HubStandin {
  /** The Hub's base URL, as HF_ENDPOINT takes it. */
  endpoint: string;
  /** The CDN's origin. */
  cdn: string;
  requests: HubRequest[];
  /** Body bytes sent of `owner/name/path` (any commit), by the Hub and the CDN together. */
  served(file: string): number;
  /** The commit a branch or tag of a repo is at. */
  commit(repo: string, ref?: string): string;
  /** Cuts the next `times` answers for `owner/name/path` after `after` body bytes. */
  cut(file: string, after: number, times: number): void;
  /** Announces `sha256` for `owner/name/path` instead of the true one. */
  lie(file: string, sha256: string): void;
  /** Leaves `size`, `blobId` and `lfs` out of the listing even with `?blobs=true`. */
  listWithoutBlobs: boolean;
  close(): Promise<void>;
}

interface Stored {
  bytes: Buffer;
  sha256: string;
  blobId: string;
  lfs: boolean;
}

interface Commit {
  sha: string;
  files: Map<string, Stored>;
}

const SIGNATURE = "X-Amz-Signature=standin";

export async function startHubStandin(options: {
  repos: StandinRepo[];
  /** Token → the gated repos it was granted; a token not listed is invalid. */
  tokens?: Record<string, string[]>;
  /** Old repo id → the id it was renamed to. */
  renamed?: Record<string, string>;
}): Promise<HubStandin> {
  const requests: HubRequest[] = [];
  const served = new Map<string, number>();
  const cuts = new Map<string, { after: number; times: number }>();
  const lies = new Map<string, string>();
  const tokens = options.tokens ?? {};
  /** repo → ref → commit; and every commit by sha. */
  const repos = new Map<string, { repo: StandinRepo; refs: Map<string, Commit> }>();
  const commits = new Map<string, { repo: string; commit: Commit }>();
  /** LFS objects by sha256, with the file they were last asked for as. */
  const objects = new Map<string, Stored>();
  for (const repo of options.repos) {
    const refs = new Map<string, Commit>();
    for (const [ref, files] of Object.entries(repo.refs)) {
      const stored = new Map<string, Stored>();
      for (const [path, content] of Object.entries(files)) {
        const bytes = Buffer.from(typeof content === "string" ? content : content);
        const isLfs = repo.lfs
          ? repo.lfs(path)
          : /\.(safetensors|bin|pt|pth|pkl|ckpt)$/.test(path) || bytes.length > 10 << 20;
        const entry = {
          bytes,
          sha256: createHash("sha256").update(bytes).digest("hex"),
          blobId: gitBlobId(bytes),
          lfs: isLfs,
        };
        stored.set(path, entry);
        if (isLfs) objects.set(entry.sha256, entry);
      }
      const sha = createHash("sha1")
        .update(`${repo.id}\n${ref}\n`)
        .update([...stored].map(([p, f]) => `${p} ${f.blobId}`).join("\n"))
        .digest("hex");
      const commit = { sha, files: stored };
      refs.set(ref, commit);
      commits.set(sha, { repo: repo.id, commit });
    }
    repos.set(repo.id, { repo, refs });
  }

  const standin: HubStandin = {
    endpoint: "",
    cdn: "",
    requests,
    served: (file) => served.get(file) ?? 0,
    commit: (repo, ref = "main") => repos.get(repo)!.refs.get(ref)!.sha,
    cut: (file, after, times) => void cuts.set(file, { after, times }),
    lie: (file, sha256) => void lies.set(file, sha256),
    listWithoutBlobs: false,
    close: async () => {
      await Promise.all([close(hub), close(cdn)]);
    },
  };

  const announced = (file: string, stored: Stored) => lies.get(file) ?? stored.sha256;

  /** Sends `bytes` (or the asked range of them), counting them for `file`, cut off when a cut
   * is pending for it. */
  const send = (
    req: IncomingMessage,
    res: ServerResponse,
    record: HubRequest,
    file: string,
    bytes: Buffer,
    headers: Record<string, string>,
  ) => {
    let start = 0;
    let end = bytes.length - 1;
    let status = 200;
    const range = req.headers.range;
    if (range) {
      const m = /^bytes=(\d+)-(\d*)$/.exec(range);
      const from = m ? Number(m[1]) : Number.NaN;
      const to = m?.[2] ? Math.min(Number(m[2]), bytes.length - 1) : bytes.length - 1;
      if (!m || from >= bytes.length || from > to) {
        record.status = 416;
        res.writeHead(416, { "content-range": `bytes */${bytes.length}` }).end();
        return;
      }
      [start, end, status] = [from, to, 206];
    }
    const body = bytes.subarray(start, end + 1);
    record.status = status;
    res.writeHead(status, {
      ...headers,
      "accept-ranges": "bytes",
      "content-length": String(body.length),
      ...(status === 206 ? { "content-range": `bytes ${start}-${end}/${bytes.length}` } : {}),
    });
    if (req.method === "HEAD") {
      res.end();
      return;
    }
    const cut = cuts.get(file);
    if (cut && cut.times > 0 && body.length > cut.after) {
      cut.times--;
      const part = body.subarray(0, cut.after);
      // Once the part is handed to the kernel, the connection is dropped mid-body.
      res.write(part, () => {
        served.set(file, (served.get(file) ?? 0) + part.length);
        res.socket?.destroy();
      });
      return;
    }
    res.end(body, () => served.set(file, (served.get(file) ?? 0) + body.length));
  };

  const hubError = (
    res: ServerResponse,
    record: HubRequest,
    status: number,
    code: string | null,
    message: string,
  ) => {
    record.status = status;
    res.writeHead(status, {
      "content-type": "application/json",
      ...(code ? { "x-error-code": code } : {}),
      "x-error-message": message,
    });
    res.end(JSON.stringify({ error: message }));
  };

  const hub = createServer((req, res) => {
    const url = new URL(req.url ?? "/", "http://hub");
    const record: HubRequest = {
      server: "hub",
      method: req.method ?? "GET",
      url: req.url ?? "/",
      ...(req.headers.range ? { range: req.headers.range } : {}),
      ...(req.headers.authorization ? { authorization: req.headers.authorization } : {}),
    };
    requests.push(record);
    const auth = /^Bearer (.+)$/.exec(req.headers.authorization ?? "")?.[1];
    if (auth !== undefined && !(auth in tokens))
      return hubError(res, record, 401, null, "Invalid credentials in Authorization header");
    const segments = url.pathname.split("/").slice(1);
    const api = segments[0] === "api" && segments[1] === "models" && segments[4] === "revision";
    const [owner, name] = api ? [segments[2], segments[3]] : [segments[0], segments[1]];
    const renamedTo = options.renamed?.[`${owner}/${name}`];
    if (renamedTo) {
      const at = api ? 3 : 1;
      const moved = [
        ...segments.slice(0, at - 1),
        ...renamedTo.split("/"),
        ...segments.slice(at + 1),
      ];
      record.status = 307;
      res.writeHead(307, { location: `/${moved.join("/")}${url.search}` }).end();
      return;
    }
    const known = repos.get(`${owner}/${name}`);
    if (!known) return hubError(res, record, 401, "RepoNotFound", "Repository not found");
    const repoId = known.repo.id;
    const revisionOf = (raw: string | undefined) => {
      const rev = decodeURIComponent(raw ?? "");
      return known.refs.get(rev) ?? [...known.refs.values()].find((c) => c.sha === rev);
    };
    if (api && req.method === "GET" && segments.length === 6) {
      const commit = revisionOf(segments[5]);
      if (!commit)
        return hubError(res, record, 404, "RevisionNotFound", `Invalid rev id: ${segments[5]}`);
      const blobs = url.searchParams.get("blobs") === "true" && !standin.listWithoutBlobs;
      const siblings = [...commit.files].map(([path, f]) => ({
        rfilename: path,
        ...(blobs
          ? {
              size: f.bytes.length,
              blobId: f.blobId,
              ...(f.lfs
                ? {
                    lfs: {
                      sha256: announced(`${repoId}/${path}`, f),
                      size: f.bytes.length,
                      pointerSize: 134,
                    },
                  }
                : {}),
            }
          : {}),
      }));
      record.status = 200;
      res.writeHead(200, { "content-type": "application/json" });
      res.end(
        JSON.stringify({
          _id: commit.sha.slice(0, 24),
          id: repoId,
          modelId: repoId,
          author: owner,
          sha: commit.sha,
          lastModified: "2026-11-01T00:00:00.000Z",
          private: false,
          gated: known.repo.gated ? "auto" : false,
          disabled: false,
          tags: ["safetensors"],
          library_name: "transformers",
          siblings,
        }),
      );
      return;
    }
    if (segments[2] !== "resolve" || (req.method !== "GET" && req.method !== "HEAD"))
      return hubError(res, record, 404, null, "Not Found");
    const commit = revisionOf(segments[3]);
    if (known.repo.gated) {
      if (auth === undefined)
        return hubError(
          res,
          record,
          401,
          "GatedRepo",
          `Access to model ${repoId} is restricted. You must have access to it and be authenticated to access it. Please log in.`,
        );
      if (!tokens[auth]?.includes(repoId))
        return hubError(
          res,
          record,
          403,
          "GatedRepo",
          `Access to model ${repoId} is restricted and you are not in the authorized list. Visit ${standin.endpoint}/${repoId} to ask for access.`,
        );
    }
    if (!commit)
      return hubError(res, record, 404, "RevisionNotFound", `Invalid rev id: ${segments[3]}`);
    const path = segments.slice(4).map(decodeURIComponent).join("/");
    const stored = commit.files.get(path);
    if (!stored) return hubError(res, record, 404, "EntryNotFound", "Entry not found");
    const file = `${repoId}/${path}`;
    record.file = file;
    if (stored.lfs) {
      const sha256 = announced(file, stored);
      record.status = 302;
      res.writeHead(302, {
        location: `${standin.cdn}/repos/${stored.sha256.slice(0, 2)}/${stored.sha256}?${SIGNATURE}&file=${encodeURIComponent(file)}`,
        "x-repo-commit": commit.sha,
        "x-linked-etag": `"${sha256}"`,
        "x-linked-size": String(stored.bytes.length),
        "content-length": "0",
      });
      res.end();
      return;
    }
    send(req, res, record, file, stored.bytes, {
      "content-type": "application/octet-stream",
      etag: `"${stored.blobId}"`,
      "x-repo-commit": commit.sha,
    });
  });

  const cdn = createServer((req, res) => {
    const url = new URL(req.url ?? "/", "http://cdn");
    const file = url.searchParams.get("file") ?? undefined;
    const record: HubRequest = {
      server: "cdn",
      method: req.method ?? "GET",
      url: req.url ?? "/",
      ...(file ? { file } : {}),
      ...(req.headers.range ? { range: req.headers.range } : {}),
      ...(req.headers.authorization ? { authorization: req.headers.authorization } : {}),
    };
    requests.push(record);
    const xml = (status: number, code: string) => {
      record.status = status;
      res.writeHead(status, { "content-type": "application/xml" });
      res.end(`<?xml version="1.0" encoding="UTF-8"?><Error><Code>${code}</Code></Error>`);
    };
    if (req.headers.authorization) return xml(400, "InvalidArgument");
    if (!url.search.includes(SIGNATURE)) return xml(403, "AccessDenied");
    const sha256 = url.pathname.split("/").pop() ?? "";
    const stored = objects.get(sha256);
    if (!stored || !file) return xml(404, "NoSuchKey");
    send(req, res, record, file, stored.bytes, {
      "content-type": "binary/octet-stream",
      etag: `"${stored.sha256}"`,
    });
  });

  standin.endpoint = `http://127.0.0.1:${await listen(hub)}`;
  standin.cdn = `http://127.0.0.1:${await listen(cdn)}`;
  return standin;
}

/** A shipped model's folder as a repo's files (`arbor/tiny-chat`: config, tokenizer, weights). */
export function shippedModelFiles(id = "arbor/tiny-chat"): Record<string, Buffer> {
  const dir = catalogModelDir(id);
  return Object.fromEntries(readdirSync(dir).map((f) => [f, readFileSync(join(dir, f))]));
}

/** git's blob id: SHA-1 of `blob <size>\0` and the bytes. */
export function gitBlobId(bytes: Uint8Array): string {
  return createHash("sha1").update(`blob ${bytes.length}\0`).update(bytes).digest("hex");
}

function listen(server: Server): Promise<number> {
  return new Promise((resolve, reject) => {
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => resolve((server.address() as AddressInfo).port));
  });
}

function close(server: Server): Promise<void> {
  server.closeAllConnections();
  return new Promise((resolve) => server.close(() => resolve()));
}
