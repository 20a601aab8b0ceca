import { readFile, stat } from "node:fs/promises";
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import { isAbsolute, join, relative } from "node:path";
import { Readable } from "node:stream";
import tar from "tar-stream";
import type { RunningServer } from "./harness.ts";

/** One request the stand-in received, in arrival order. */
export interface UpstreamCall {
  method: string;
  path: string;
  body: Record<string, unknown> | undefined;
  /** Its answer's status. */
  status?: number;
}

export interface VllmStandin {
  /** Its base URL, ending in `/v1`, as ARBOR_UPSTREAMS takes it. */
  url: string;
  calls: UpstreamCall[];
  /** The adapters it has loaded: `lora_name` → the folder it read them from. */
  loaded: ReadonlyMap<string, string>;
  /** The most adapters it has had loaded at once since `resetPeak()` (or its start). */
  peakLoaded(): number;
  resetPeak(): void;
  /** Forgets every adapter loaded at run time, as vLLM does when it restarts. */
  restart(): void;
  /** Holds the next loads until `release()`; `arrived` resolves when the first one is in. */
  holdLoads(): { arrived: Promise<void>; release(): void };
  close(): Promise<void>;
}

export interface VllmStandinOptions {
  /** The name it serves its base model under (vLLM's `--served-model-name`). */
  servedModel: string;
  /** The real Arbor server that generates: the base model there, and each adapter loaded. */
  backing: RunningServer;
  backingBase: string;
  /** Where the shared directory is mounted on "its" filesystem: a `lora_path` under `at` is
   * read from `dir`. A path outside it does not exist for it. */
  mount: { at: string; dir: string };
  /** vLLM's `--max-lora-rank` (default 16). */
  maxLoraRank?: number;
}

/** What vLLM's `--enable-lora` supports on a Llama-style model: every linear, q/k/v packed as
 * `qkv_proj` and gate/up as `gate_up_proj`, which expand to these names. */
const EXPECTED_MODULES = new Set([
  "q_proj",
  "k_proj",
  "v_proj",
  "o_proj",
  "gate_proj",
  "up_proj",
  "down_proj",
]);

/**
 * A stand-in for vLLM's OpenAI-compatible server with `--enable-lora` and
 * `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, written from vLLM's source (serving_models.py, the
 * LoRA router and protocol, peft_helper.py, lora_model.py, serving.py's `_check_model`; no vLLM
 * runs here). It records every call, and answers as vLLM does:
 *
 * - `POST /v1/load_lora_adapter {lora_name, lora_path}`: 400 when either is missing or the name
 *   is already loaded; the folder is read as vLLM reads it (`adapter_config.json` with `r`,
 *   `lora_alpha`, `target_modules`, no `modules_to_save`, no DoRA, `r` ≤ max rank;
 *   `adapter_model.safetensors` whose tensors are `base_model.model.<module>.lora_{A,B}.weight`
 *   of supported modules) and a folder it cannot find is 404 "No adapter found"; then 200 with
 *   a plain-text success line.
 * - `POST /v1/unload_lora_adapter {lora_name}`: 404 for a name it does not have.
 * - `GET /v1/models`: the base and each loaded adapter by name.
 * - `POST /v1/chat/completions`: the base or a loaded adapter by `model`; any other name is
 *   404 "The model `…` does not exist.".
 *
 * Generation is real: a loaded adapter's two files are uploaded to the backing Arbor server as
 * a checkpoint (checked there tensor by tensor against the base), and chats are forwarded to it.
 */
export async function startVllmStandin(options: VllmStandinOptions): Promise<VllmStandin> {
  const calls: UpstreamCall[] = [];
  /** lora_name → the backing server's chat id for it. */
  const served = new Map<string, string>();
  const loaded = new Map<string, string>();
  let hold: { gate: Promise<void>; arrived: () => void } | undefined;
  let counter = 0;
  let peak = 0;
  const backing = options.backing.authorizedClient();

  /** Where `path` is on this machine, seen from the stand-in's filesystem: only what is under
   * its mount of the shared directory exists for it. */
  const onItsFilesystem = (path: string): string | undefined => {
    if (!isAbsolute(path)) return undefined;
    const inside = relative(options.mount.at, path);
    if (inside.startsWith("..") || isAbsolute(inside)) return undefined;
    return join(options.mount.dir, inside);
  };

  async function load(body: Record<string, unknown>): Promise<[number, unknown]> {
    const name = typeof body.lora_name === "string" ? body.lora_name : "";
    const path = typeof body.lora_path === "string" ? body.lora_path : "";
    if (!name || !path) {
      return error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput");
    }
    if (loaded.has(name)) {
      return error(
        400,
        `The lora adapter '${name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.`,
        "InvalidUserInput",
      );
    }
    const dir = onItsFilesystem(path);
    const config = dir ? await readFile(join(dir, "adapter_config.json")).catch(() => null) : null;
    if (!dir || !config) {
      return error(
        404,
        `Loading lora ${name} failed: No adapter found for ${path}`,
        "NotFoundError",
      );
    }
    const tensors = await readFile(join(dir, "adapter_model.safetensors")).catch(() => null);
    if (!tensors) return error(400, `${path} doesn't contain tensors`);
    const problem = peftProblem(JSON.parse(config.toString("utf8")), tensors, options);
    if (problem) return error(400, problem);
    const number = ++counter;
    const model = await backing.training.models.create({
      project: "standin",
      name: `lora-${number}`,
      base_model: options.backingBase,
    });
    const upload = await fetch(
      `${options.backing.baseUrl}/v1/preview/models/${model.id}/checkpoints`,
      {
        method: "POST",
        headers: {
          authorization: `Bearer ${options.backing.adminKey}`,
          "content-type": "application/x-tar",
        },
        body: new Uint8Array(
          await tarOf({ "adapter_config.json": config, "adapter_model.safetensors": tensors }),
        ),
      },
    );
    if (!upload.ok) return error(400, `cannot load ${path}: ${await upload.text()}`);
    served.set(name, `default/standin/lora-${number}`);
    loaded.set(name, dir);
    peak = Math.max(peak, loaded.size);
    return [200, `Success: LoRA adapter '${name}' added successfully.`];
  }

  async function handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const text = await new Promise<string>((resolve) => {
      let data = "";
      req.setEncoding("utf8");
      req.on("data", (chunk: string) => {
        data += chunk;
      });
      req.on("end", () => resolve(data));
    });
    const path = (req.url ?? "").split("?")[0] ?? "";
    const call: UpstreamCall = {
      method: req.method ?? "",
      path,
      body: text ? (JSON.parse(text) as Record<string, unknown>) : undefined,
    };
    calls.push(call);
    const answer = (status: number, body: unknown) => {
      call.status = status;
      const plain = typeof body === "string";
      res.writeHead(status, {
        "content-type": plain ? "text/plain; charset=utf-8" : "application/json",
      });
      res.end(plain ? body : JSON.stringify(body));
    };
    const json = req.headers["content-type"]?.startsWith("application/json");
    if (req.method === "POST" && !json) {
      return answer(415, { detail: "Unsupported Media Type: Only 'application/json' is allowed" });
    }
    const body = call.body ?? {};
    if (req.method === "POST" && path === "/v1/load_lora_adapter") {
      if (hold) {
        hold.arrived();
        await hold.gate;
      }
      const [status, out] = await load(body);
      return answer(status, out);
    }
    if (req.method === "POST" && path === "/v1/unload_lora_adapter") {
      const name = typeof body.lora_name === "string" ? body.lora_name : "";
      if (!name) {
        return answer(
          ...error(
            400,
            "'lora_name' needs to be provided to unload a LoRA adapter.",
            "InvalidUserInput",
          ),
        );
      }
      if (!loaded.delete(name)) {
        return answer(
          ...error(404, `The lora adapter '${name}' cannot be found.`, "NotFoundError"),
        );
      }
      served.delete(name);
      return answer(200, `Success: LoRA adapter '${name}' removed successfully.`);
    }
    if (req.method === "GET" && path === "/v1/models") {
      return answer(200, {
        object: "list",
        data: [
          { id: options.servedModel, object: "model", owned_by: "vllm", parent: null },
          ...[...loaded].map(([id, root]) => ({
            id,
            object: "model",
            owned_by: "vllm",
            root,
            parent: options.servedModel,
          })),
        ],
      });
    }
    if (req.method === "POST" && path === "/v1/chat/completions") {
      const requested = String(body.model);
      const model = requested === options.servedModel ? options.backingBase : served.get(requested);
      if (!model) {
        return answer(
          ...error(404, `The model \`${requested}\` does not exist.`, "NotFoundError", "model"),
        );
      }
      const response = await fetch(`${options.backing.baseUrl}/v1/chat/completions`, {
        method: "POST",
        headers: {
          authorization: `Bearer ${options.backing.adminKey}`,
          "content-type": "application/json",
        },
        body: JSON.stringify({ ...body, model }),
      });
      call.status = response.status;
      res.writeHead(response.status, {
        "content-type": response.headers.get("content-type") ?? "application/json",
      });
      if (response.body) Readable.fromWeb(response.body).pipe(res);
      else res.end();
      return;
    }
    answer(404, { detail: "Not Found" });
  }

  const server: Server = createServer((req, res) => {
    handle(req, res).catch((err: unknown) => {
      if (!res.headersSent) res.writeHead(500, { "content-type": "application/json" });
      res.end(JSON.stringify({ error: { message: String(err), code: 500 } }));
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const address = server.address();
  if (typeof address !== "object" || !address) throw new Error("the stand-in did not listen");

  return {
    url: `http://127.0.0.1:${address.port}/v1`,
    calls,
    loaded,
    peakLoaded: () => peak,
    resetPeak() {
      peak = loaded.size;
    },
    restart() {
      loaded.clear();
      served.clear();
    },
    holdLoads() {
      let release!: () => void;
      let arrived!: () => void;
      const gate = new Promise<void>((resolve) => {
        release = resolve;
      });
      const first = new Promise<void>((resolve) => {
        arrived = resolve;
      });
      hold = { gate, arrived };
      return {
        arrived: first,
        release: () => {
          hold = undefined;
          release();
        },
      };
    },
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections();
        server.close(() => resolve());
      }),
  };
}

/** vLLM's error body (`ErrorResponse`): `{error: {message, type, param, code}}`. */
function error(
  status: number,
  message: string,
  type = "BadRequestError",
  param: string | null = null,
): [number, unknown] {
  return [status, { error: { message, type, param, code: status } }];
}

/** Why vLLM would refuse the adapter, or undefined: PEFTHelper's checks on the config, and
 * LoRAModel.from_local_checkpoint's on the tensors' names (and the rank of their shapes). */
function peftProblem(
  config: Record<string, unknown>,
  safetensors: Buffer,
  options: VllmStandinOptions,
): string | undefined {
  const missing = ["r", "lora_alpha", "target_modules"].filter((f) => !(f in config));
  if (missing.length > 0) return `Missing required configuration fields: {${missing.join(", ")}}`;
  if (config.modules_to_save) return "vLLM only supports modules_to_save being None.";
  if (config.use_dora) return "vLLM does not yet support DoRA.";
  if (config.bias !== undefined && config.bias !== "none")
    return "Adapter bias cannot be used without bias_enabled.";
  const rank = Number(config.r);
  const maxRank = options.maxLoraRank ?? 16;
  if (rank > maxRank) return `LoRA rank ${rank} is greater than max_lora_rank ${maxRank}.`;
  const headerLength = Number(safetensors.readBigUInt64LE(0));
  const header = JSON.parse(safetensors.subarray(8, 8 + headerLength).toString("utf8")) as Record<
    string,
    { shape?: number[] }
  >;
  const unexpected: string[] = [];
  let count = 0;
  for (const [name, info] of Object.entries(header)) {
    if (name === "__metadata__") continue;
    const match = /^base_model\.model\.(.+)\.lora_(A|B)\.weight$/.exec(name);
    if (!match) return `${name} is unsupported LoRA weight`;
    const module = match[1]!;
    if (!EXPECTED_MODULES.has(module.split(".").at(-1)!)) unexpected.push(module);
    const shape = info.shape ?? [];
    const r = match[2] === "A" ? shape[0] : shape[1];
    if (shape.length !== 2 || r !== rank) return `${name} has shape [${shape}], not rank ${rank}`;
    count++;
  }
  if (unexpected.length > 0) {
    return `expected target modules in ${[...EXPECTED_MODULES]} but received ${unexpected}. Please verify that the loaded LoRA module is correct`;
  }
  return count === 0 ? "the adapter has no LoRA weights" : undefined;
}

async function tarOf(files: Record<string, Buffer>): Promise<Buffer> {
  const pack = tar.pack();
  for (const [name, body] of Object.entries(files)) pack.entry({ name }, body);
  pack.finalize();
  const chunks: Buffer[] = [];
  for await (const chunk of pack) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks);
}

/** Whether `dir` holds the folder of `name` (for tests that look at the shared directory). */
export async function folderExists(dir: string): Promise<boolean> {
  return (await stat(dir).catch(() => undefined))?.isDirectory() ?? false;
}
