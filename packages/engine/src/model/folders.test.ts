import { cp, mkdtemp, readFile, rm, truncate, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { FAMILIES, familyChatFiles } from "../../test/families.ts";
import { memory64Limit } from "../kernels/wasm.ts";
import { checkModelFolder, scanBaseModels } from "./folders.ts";
import { randomModel, saveModel } from "./model.ts";

const qwen3Files = familyChatFiles(FAMILIES.find((f) => f.name === "Qwen3")!);
const shape = {
  model_type: "qwen3",
  hidden_size: 64,
  intermediate_size: 128,
  num_hidden_layers: 1,
  num_attention_heads: 2,
  num_key_value_heads: 1,
  head_dim: 32,
  vocab_size: 151936,
};

/** A models directory with `qwen/ok` and a copy of it per case, broken by the case. */
async function modelsDir(
  cases: Record<string, (dir: string) => Promise<void>>,
): Promise<{ root: string }> {
  const root = await mkdtemp(join(tmpdir(), "arbor-folders-"));
  const model = randomModel(shape, qwen3Files, 1);
  const ok = join(root, "qwen", "ok");
  await saveModel(model, ok, { dtype: "BF16" });
  for (const [name, breakIt] of Object.entries(cases)) {
    const dir = join(root, "qwen", name);
    await cp(ok, dir, { recursive: true });
    await breakIt(dir);
  }
  return { root };
}

const editConfig = (edit: (c: Record<string, unknown>) => void) => async (dir: string) => {
  const path = join(dir, "config.json");
  const config = JSON.parse(await readFile(path, "utf8")) as Record<string, unknown>;
  edit(config);
  await writeFile(path, JSON.stringify(config));
};

describe("base model folders", () => {
  it("when folders cannot be served, then each is skipped with its reason and the rest are served", async () => {
    const { root } = await modelsDir({
      mistral: editConfig((c) => {
        c.model_type = "mistral";
      }),
      truncated: async (dir) => truncate(join(dir, "model.safetensors"), 1000),
      reshaped: editConfig((c) => {
        c.intermediate_size = 256;
      }),
      // An 8B shape: 32 GB of F32 weights, more than a Memory64 arena's 16 GiB.
      huge: editConfig((c) => {
        Object.assign(c, {
          hidden_size: 4096,
          intermediate_size: 12288,
          num_hidden_layers: 36,
          num_attention_heads: 32,
          num_key_value_heads: 8,
          head_dim: 128,
        });
      }),
      "no-template": async (dir) => {
        const path = join(dir, "tokenizer_config.json");
        const config = JSON.parse(await readFile(path, "utf8")) as Record<string, unknown>;
        config.chat_template = "{% for m in messages %}";
        await writeFile(path, JSON.stringify(config));
      },
    });
    const { models, skipped } = await scanBaseModels(root);
    expect(models.filter((m) => !m.shipped).map((m) => m.id)).toEqual(["qwen/ok"]);
    // What a GGUF download needs to know, from the tokenizer the check built anyway.
    expect(models.map((m) => m.ggufPre)).toEqual(models.map(() => "qwen2"));
    const reasons = Object.fromEntries(skipped.map((s) => [s.id, s.reason]));
    expect(Object.keys(reasons).sort()).toEqual(
      ["qwen/huge", "qwen/mistral", "qwen/no-template", "qwen/reshaped", "qwen/truncated"].sort(),
    );
    expect(reasons["qwen/mistral"]).toMatch(/config\.json: model_type "mistral" is not supported/);
    expect(reasons["qwen/truncated"]).toMatch(/model\.safetensors.*truncated/);
    expect(reasons["qwen/reshaped"]).toMatch(
      /gate_proj\.weight has shape \[128,64\], config\.json says \[256,64\]/,
    );
    const limit = (memory64Limit() / 1e9).toFixed(2);
    expect(reasons["qwen/huge"]).toMatch(
      new RegExp(`too large.*3\\d\\.\\d\\d GB packed in F32, .*holds ${limit} GB`),
    );
    expect(reasons["qwen/no-template"]).toMatch(
      /tokenizer_config\.json: the chat template does not parse/,
    );
  });

  it("when only the weights are missing, then the check without tensors passes and reckons the memory from config.json; hidden folders are not scanned", async () => {
    const { root } = await modelsDir({
      "no-weights": async (dir) => rm(join(dir, "model.safetensors")),
      // A 16B shape whose config says BF16: under `auto` the check reckons BF16 weights.
      huge: editConfig((c) => {
        Object.assign(c, {
          hidden_size: 4096,
          intermediate_size: 12288,
          num_hidden_layers: 80,
          num_attention_heads: 32,
          num_key_value_heads: 8,
          head_dim: 128,
          torch_dtype: "bfloat16",
        });
      }),
    });
    const dir = join(root, "qwen", "no-weights");
    await expect(checkModelFolder(dir, { tensors: false })).resolves.toMatchObject({
      parameters: expect.any(Number),
    });
    await expect(checkModelFolder(dir)).rejects.toThrow(/model\.safetensors: missing/);
    const huge = join(root, "qwen", "huge");
    await expect(checkModelFolder(huge, { weights: "auto", tensors: false })).rejects.toThrow(
      /too large.*packed in BF16/,
    );
    await cp(join(root, "qwen", "ok"), join(root, ".pulls", "qwen"), { recursive: true });
    await cp(join(root, "qwen", "ok"), join(root, "qwen", ".staged"), { recursive: true });
    const { models, skipped } = await scanBaseModels(root);
    const ids = [...models, ...skipped].map((m) => m.id);
    expect(ids.filter((id) => id.includes(".p") || id.includes(".s"))).toEqual([]);
  });
});
