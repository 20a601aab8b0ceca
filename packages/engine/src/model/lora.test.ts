import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { randomBatch, tinyModel } from "../../test/fixtures.ts";
import { jsKernels } from "../kernels/js.ts";
import { createWasmKernels } from "../kernels/wasm.ts";
import { LoraTrainer } from "../train/lora-train.ts";
import { lossAndGradients } from "../train/train.ts";
import { createKvCache, forwardBatch } from "./forward.ts";
import {
  AdapterError,
  adapterFromFiles,
  adapterToFiles,
  adapterWeightProblem,
  createLoraAdapter,
  loadAdapter,
  loraHooks,
  loraParameters,
  mergeAdapter,
  saveAdapter,
  zerosLikeAdapter,
} from "./lora.ts";
import { Rng } from "./rng.ts";
import { readSafetensors, saveSafetensors } from "./safetensors.ts";
import { parameters } from "./weights.ts";

/** An adapter with non-zero B, so both A and B get gradients. */
function randomAdapter(model: ReturnType<typeof tinyModel>, seed: number) {
  const adapter = createLoraAdapter(model, { rank: 3, alpha: 6 }, seed);
  const rng = new Rng(seed + 1);
  for (const p of loraParameters(adapter)) {
    for (let i = 0; i < p.data.length; i++) p.data[i] = rng.normal() * 0.1;
  }
  return adapter;
}

describe("LoRA gradients", () => {
  it("when compared with central finite differences, then every A and B gradient agrees and base weights get none", () => {
    const model = tinyModel(21);
    for (const p of parameters(model.config, model.weights)) {
      if (p.shape.length === 2)
        for (let i = 0; i < p.data.length; i++) p.data[i] = p.data[i]! * 0.5;
    }
    const adapter = randomAdapter(model, 4);
    const batch = randomBatch(model.config.vocabSize, 2, 6, 12);
    const grads = zerosLikeAdapter(adapter);
    const before = parameters(model.config, model.weights).map((p) => Float32Array.from(p.data));
    lossAndGradients(model, jsKernels, batch, null, {
      hooks: loraHooks(adapter, jsKernels, grads),
    });
    parameters(model.config, model.weights).forEach((p, i) => {
      expect(p.data, p.name).toEqual(before[i]);
    });
    const loss = () =>
      lossAndGradients(model, jsKernels, batch, null, {
        hooks: loraHooks(adapter, jsKernels, null),
      }).loss;
    const gradParams = loraParameters(grads);
    const rng = new Rng(5);
    loraParameters(adapter).forEach((p, index) => {
      const g = gradParams[index]!.data;
      const order = [...g.keys()].sort((a, b) => Math.abs(g[b]!) - Math.abs(g[a]!));
      for (const i of [...order.slice(0, 2), rng.int(g.length)]) {
        const original = p.data[i]!;
        const h = 1e-2;
        p.data[i] = original + h;
        const up = loss();
        p.data[i] = original - h;
        const down = loss();
        p.data[i] = original;
        const numeric = (up - down) / (2 * h);
        expect(Math.abs(numeric - g[i]!), `${p.name}[${i}]`).toBeLessThan(
          2e-4 + 0.02 * Math.abs(numeric),
        );
      }
    });
  });

  it("when a custom objective is given, then its gradient matches finite differences", () => {
    const model = tinyModel(22);
    const adapter = randomAdapter(model, 6);
    const batch = randomBatch(model.config.vocabSize, 1, 7, 13);
    const coef = Float32Array.from({ length: 7 }, (_, i) => (i % 3) - 1);
    // loss = Σ coef·exp(logp) (a ratio-like, non-linear objective of the log-probs).
    const objective = (lp: Float32Array) => {
      const grad = new Float32Array(lp.length);
      let loss = 0;
      for (let r = 0; r < lp.length; r++) {
        loss += coef[r]! * Math.exp(lp[r]!);
        grad[r] = coef[r]! * Math.exp(lp[r]!);
      }
      return { loss, grad };
    };
    const grads = zerosLikeAdapter(adapter);
    lossAndGradients(model, jsKernels, batch, null, {
      hooks: loraHooks(adapter, jsKernels, grads),
      objective,
    });
    const p = loraParameters(adapter)[1]!;
    const g = loraParameters(grads)[1]!.data;
    for (const i of [0, 5, 11]) {
      const original = p.data[i]!;
      const h = 1e-2;
      const at = (x: number) => {
        p.data[i] = x;
        return lossAndGradients(model, jsKernels, batch, null, {
          hooks: loraHooks(adapter, jsKernels, null),
          objective,
        }).loss;
      };
      const numeric = (at(original + h) - at(original - h)) / (2 * h);
      p.data[i] = original;
      expect(Math.abs(numeric - g[i]!)).toBeLessThan(1e-4 + 0.02 * Math.abs(numeric));
    }
  });

  it("when B is zero (a fresh adapter), then the loss equals the base model's exactly", () => {
    const model = tinyModel(23);
    const adapter = createLoraAdapter(model, {}, 1);
    const batch = randomBatch(model.config.vocabSize, 2, 5, 14);
    const kernels = createWasmKernels();
    const base = lossAndGradients(model, kernels, batch, null);
    const withAdapter = lossAndGradients(model, kernels, batch, null, {
      hooks: loraHooks(adapter, kernels, null),
    });
    expect(withAdapter.loss).toBe(base.loss);
  });

  it("when trained with LoraTrainer, then the loss falls and only the adapter changes", () => {
    const model = tinyModel(24);
    const before = parameters(model.config, model.weights).map((p) => Float32Array.from(p.data));
    const adapter = createLoraAdapter(model, { rank: 4, alpha: 8 }, 2);
    const trainer = new LoraTrainer(model, adapter, { kernels: jsKernels });
    const batch = randomBatch(model.config.vocabSize, 2, 8, 15);
    const losses: number[] = [];
    for (let i = 0; i < 30; i++) {
      losses.push(trainer.backward(batch).loss);
      trainer.step(2e-2);
    }
    expect(losses.at(-1)!).toBeLessThan(losses[0]! * 0.7);
    parameters(model.config, model.weights).forEach((p, i) => {
      expect(p.data, p.name).toEqual(before[i]);
    });
  });
});

describe("LoRA files", () => {
  it("when saved, then the files follow PEFT's layout and load back bit-identically", async () => {
    const model = tinyModel(25);
    const adapter = randomAdapter(model, 7);
    adapter.baseModel = "arbor/tiny";
    const files = adapterToFiles(adapter);
    const config = JSON.parse(new TextDecoder().decode(files["adapter_config.json"]));
    expect(config).toMatchObject({
      peft_type: "LORA",
      task_type: "CAUSAL_LM",
      r: 3,
      lora_alpha: 6,
      base_model_name_or_path: "arbor/tiny",
      target_modules: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    });
    const { tensors } = readSafetensors(files["adapter_model.safetensors"]!);
    const qa = tensors.get("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
    const qb = tensors.get("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight");
    const down = tensors.get("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight");
    const c = model.config;
    expect(qa?.shape).toEqual([3, c.hiddenSize]);
    expect(qb?.shape).toEqual([c.numHeads * c.headDim, 3]);
    expect(down?.shape).toEqual([c.hiddenSize, 3]);
    expect(tensors.size).toBe(2 * 7 * c.numLayers);

    const back = adapterFromFiles(files, model);
    expect(adapterToFiles(back)).toEqual(files);
    const dir = await mkdtemp(join(tmpdir(), "arbor-lora-"));
    try {
      await saveAdapter(adapter, dir);
      expect(adapterToFiles(await loadAdapter(dir, model))).toEqual(files);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it("when the target modules are a subset, then only those are adapted and saved", () => {
    const model = tinyModel(26);
    const adapter = createLoraAdapter(model, { targetModules: ["v_proj", "q_proj"], rank: 2 });
    expect(adapter.targetModules).toEqual(["q_proj", "v_proj"]);
    expect(loraParameters(adapter).map((p) => p.name)).toEqual([
      "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
      "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
      "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight",
      "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight",
      "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight",
      "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight",
      "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight",
      "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight",
    ]);
  });

  it("when a file does not fit the base model, then loading throws naming the tensor", () => {
    const model = tinyModel(27);
    const other = tinyModel(27, { hiddenSize: 24, headDim: 12 });
    const files = adapterToFiles(createLoraAdapter(other, { rank: 2 }));
    expect(() => adapterFromFiles(files, model)).toThrow(/q_proj\.lora_A\.weight has shape/);
    expect(() => adapterFromFiles({}, model)).toThrow(/adapter_config\.json/);
    const config = (targets: unknown) =>
      new TextEncoder().encode(
        JSON.stringify({ peft_type: "LORA", r: 2, lora_alpha: 4, target_modules: targets }),
      );
    const own = adapterToFiles(createLoraAdapter(model, { rank: 2, alpha: 4 }));
    expect(() =>
      adapterFromFiles({ ...own, "adapter_config.json": config(["embed_tokens"]) }, model),
    ).toThrow(/target_modules names "embed_tokens"/);
    expect(
      adapterFromFiles({ ...own, "adapter_config.json": config("all-linear") }, model)
        .targetModules,
    ).toHaveLength(7);
    const weights = own["adapter_model.safetensors"]!;
    const param = (f: () => unknown) => {
      try {
        f();
      } catch (err) {
        expect(err).toBeInstanceOf(AdapterError);
        return [(err as AdapterError).param, (err as Error).message];
      }
      throw new Error("no error");
    };
    // A rank the tensors do not have; a cut-off file; a tensor of another name.
    const rank3 = new TextEncoder().encode(
      JSON.stringify({
        peft_type: "LORA",
        r: 3,
        lora_alpha: 4,
        target_modules: ["q_proj", "v_proj"],
      }),
    );
    expect(param(() => adapterFromFiles({ ...own, "adapter_config.json": rank3 }, model))).toEqual([
      "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
      expect.stringMatching(/has shape \[2, \d+\], the base needs \[3, \d+\] \(r 3\)/),
    ]);
    expect(
      param(() =>
        adapterFromFiles(
          { ...own, "adapter_model.safetensors": weights.subarray(0, weights.length - 10) },
          model,
        ),
      ),
    ).toEqual(["adapter_model.safetensors", expect.stringMatching(/truncated/)]);
    const renamed = adapterToFiles(createLoraAdapter(model, { rank: 2, alpha: 4 }));
    const text = new TextDecoder("latin1").decode(renamed["adapter_model.safetensors"]);
    const swapped = Uint8Array.from(
      text.replace("layers.1.self_attn.q_proj", "layers.9.self_attn.q_proj"),
      (c) => c.charCodeAt(0),
    );
    expect(
      param(() => adapterFromFiles({ ...own, "adapter_model.safetensors": swapped }, model))[0],
    ).toBe("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight");
    expect(
      param(() =>
        adapterFromFiles({ ...own, "adapter_config.json": new TextEncoder().encode("{") }, model),
      )[0],
    ).toBe("adapter_config.json");
  });

  it("when a PEFT file holds BF16 tensors, then they load as F32", () => {
    const model = tinyModel(27);
    const adapter = createLoraAdapter(model, { rank: 2, alpha: 4, targetModules: ["q_proj"] }, 3);
    for (const p of loraParameters(adapter)) p.data.fill(0.375);
    const tensors = new Map(
      loraParameters(adapter).map((p) => [p.name, { shape: p.shape, data: p.data }]),
    );
    const files = adapterToFiles(adapter);
    const bf16 = saveSafetensors(tensors, { format: "pt" }, "BF16");
    const back = adapterFromFiles({ ...files, "adapter_model.safetensors": bf16 }, model);
    for (const p of loraParameters(back)) expect([...new Set(p.data)]).toEqual([0.375]);
  });

  /** The param and message of what loading `files` throws (an AdapterError). */
  function refusal(files: Record<string, Uint8Array>, model: ReturnType<typeof tinyModel>) {
    try {
      adapterFromFiles(files, model);
    } catch (err) {
      expect(err).toBeInstanceOf(AdapterError);
      return { param: (err as AdapterError).param, message: (err as Error).message };
    }
    throw new Error("no error");
  }

  it("when a weight is NaN, infinite or larger than 65504, then loading refuses it naming the tensor; 65504 itself loads", () => {
    const model = tinyModel(29);
    const qb = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight";
    const withWeight = (value: number) => {
      const adapter = createLoraAdapter(model, { rank: 2, alpha: 4 }, 1);
      adapter.layers[1]!.q!.b[3] = value;
      return adapterToFiles(adapter);
    };
    for (const value of [Number.NaN, Number.POSITIVE_INFINITY, -Infinity, 1e30, -65505]) {
      expect(refusal(withWeight(value), model)).toEqual({
        param: qb,
        message: `adapter_model.safetensors: ${qb} holds ${Math.fround(value)} at index 3; every weight must be a finite number of magnitude at most 65504.`,
      });
    }
    expect(adapterFromFiles(withWeight(-65504), model).layers[1]!.q!.b[3]).toBe(-65504);
    // F16 and BF16 files are checked as widened: an F16 infinity is refused too.
    const adapter = createLoraAdapter(model, { rank: 2, alpha: 4, targetModules: ["q_proj"] }, 1);
    adapter.layers[0]!.q!.a[0] = 1e6;
    const tensors = new Map(
      loraParameters(adapter).map((p) => [p.name, { shape: p.shape, data: p.data }]),
    );
    const bf16 = saveSafetensors(tensors, { format: "pt" }, "BF16");
    expect(
      refusal({ ...adapterToFiles(adapter), "adapter_model.safetensors": bf16 }, model).param,
    ).toBe("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  });

  it("when r or lora_alpha is out of bounds, then loading refuses it naming the field", () => {
    const model = tinyModel(30);
    const files = adapterToFiles(createLoraAdapter(model, { rank: 2, alpha: 4 }, 1));
    const config = JSON.parse(new TextDecoder().decode(files["adapter_config.json"]));
    const edited = (edit: Record<string, unknown>) => ({
      ...files,
      "adapter_config.json": new TextEncoder().encode(JSON.stringify({ ...config, ...edit })),
    });
    for (const r of [0, 257, 2.5, "2"]) expect(refusal(edited({ r }), model).param).toBe("r");
    for (const lora_alpha of [0, -4, 10_001, 1e308, "4"]) {
      expect(refusal(edited({ lora_alpha }), model)).toEqual({
        param: "lora_alpha",
        message: `adapter_config.json: lora_alpha must be a number above 0 and at most 10000, not ${JSON.stringify(lora_alpha)}.`,
      });
    }
    expect(adapterFromFiles(edited({ lora_alpha: 10_000 }), model).scale).toBe(5000);
  });

  it("when the safetensors header names a tensor twice, as it is or with PEFT's adapter-name infix, then loading refuses it naming the tensor", () => {
    const model = tinyModel(31);
    const files = adapterToFiles(
      createLoraAdapter(model, { rank: 2, alpha: 4, targetModules: ["q_proj", "v_proj"] }, 1),
    );
    const bytes = files["adapter_model.safetensors"]!;
    const length = Number(new DataView(bytes.buffer, bytes.byteOffset).getBigUint64(0, true));
    const header = new TextDecoder().decode(bytes.subarray(8, 8 + length)).trimEnd();
    const data = bytes.subarray(8 + length);
    const name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    const entry = JSON.stringify(JSON.parse(header)[name]);
    const rewritten = (extra: string) => {
      const text = new TextEncoder().encode(`${header.slice(0, -1)},${extra}}`);
      const out = new Uint8Array(8 + text.length + data.length);
      new DataView(out.buffer).setBigUint64(0, BigInt(text.length), true);
      out.set(text, 8);
      out.set(data, 8 + text.length);
      return { ...files, "adapter_model.safetensors": out };
    };
    expect(refusal(rewritten(`"${name}":${entry}`), model)).toEqual({
      param: name,
      message: `adapter_model.safetensors: the header names ${name} twice.`,
    });
    const infix = name.replace(".lora_A.", ".lora_A.default.");
    expect(refusal(rewritten(`"${infix}":${entry}`), model)).toEqual({
      param: name,
      message: `adapter_model.safetensors: holds ${name} twice (as ${infix} too).`,
    });
  });

  it("when the header lists more tensors than the base has linears for, then it is refused before it is parsed", () => {
    const model = tinyModel(32);
    const files = adapterToFiles(createLoraAdapter(model, { rank: 2, alpha: 4 }, 1));
    const most = 2 * 7 * model.config.numLayers;
    const entries = Array.from(
      { length: most + 1 },
      (_, i) => `"t${i}":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}`,
    );
    const text = new TextEncoder().encode(`{${entries.join(",")}}`);
    const bytes = new Uint8Array(8 + text.length + 4);
    new DataView(bytes.buffer).setBigUint64(0, BigInt(text.length), true);
    bytes.set(text, 8);
    expect(refusal({ ...files, "adapter_model.safetensors": bytes }, model)).toEqual({
      param: "adapter_model.safetensors",
      message: `adapter_model.safetensors: the header lists more than ${most} tensors.`,
    });
    // A header longer than such a list could need is refused from its length.
    const long = new Uint8Array(16);
    new DataView(long.buffer).setBigUint64(0, BigInt(100 * 1024 * 1024), true);
    expect(refusal({ ...files, "adapter_model.safetensors": long }, model).message).toMatch(
      /the header is 104857600 bytes, more than the \d+ allowed/,
    );
  });

  it("when an adapter holds a weight out of bounds, then adapterWeightProblem names its tensor; a sound one has none", () => {
    const model = tinyModel(33);
    const adapter = createLoraAdapter(model, { rank: 2, alpha: 4 }, 1);
    expect(adapterWeightProblem(adapter)).toBeUndefined();
    adapter.layers[0]!.down!.b[1] = Number.NaN;
    expect(adapterWeightProblem(adapter)).toEqual({
      name: "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight",
      message:
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight holds NaN at index 1; every weight must be a finite number of magnitude at most 65504.",
    });
  });

  it("when the optimizer state is saved and restored, then training continues identically", () => {
    const model = tinyModel(28);
    const batch = randomBatch(model.config.vocabSize, 2, 6, 16);
    const run = (split: boolean) => {
      let adapter = createLoraAdapter(model, { rank: 2 }, 3);
      let trainer = new LoraTrainer(model, adapter, { kernels: jsKernels });
      for (let i = 0; i < 6; i++) {
        if (split && i === 3) {
          const state = trainer.optimizerStateToBytes();
          adapter = adapterFromFiles(adapterToFiles(adapter), model);
          trainer = new LoraTrainer(model, adapter, { kernels: jsKernels });
          trainer.loadOptimizerState(state);
          expect(trainer.stepCount).toBe(3);
        }
        trainer.backward(batch);
        trainer.step(1e-2);
      }
      return adapterToFiles(adapter)["adapter_model.safetensors"];
    };
    expect(run(true)).toEqual(run(false));
  });
});

describe("mergeAdapter", () => {
  it("when an adapter is merged into its base, then the merged model computes what the base with the adapter does, and the base is unchanged", () => {
    const model = tinyModel(41);
    const adapter = createLoraAdapter(model, { rank: 3, alpha: 6 }, 2);
    const rng = new Rng(5);
    for (const p of loraParameters(adapter))
      for (let i = 0; i < p.data.length; i++) p.data[i] = 0.1 * rng.normal();
    const before = Float32Array.from(model.weights.layers[0]!.q);
    const merged = mergeAdapter(model, adapter);
    expect(model.weights.layers[0]!.q).toEqual(before);
    const tokens = [3, 14, 15, 92, 65, 35];
    const [adapted] = forwardBatch(model, jsKernels, [
      { cache: createKvCache(model), tokens, adapter },
    ]);
    const [folded] = forwardBatch(merged, jsKernels, [{ cache: createKvCache(merged), tokens }]);
    const [plain] = forwardBatch(model, jsKernels, [{ cache: createKvCache(model), tokens }]);
    let diff = 0;
    let moved = 0;
    for (let i = 0; i < adapted!.length; i++) {
      diff = Math.max(diff, Math.abs(adapted![i]! - folded![i]!));
      moved = Math.max(moved, Math.abs(adapted![i]! - plain![i]!));
    }
    expect(diff).toBeLessThan(1e-4);
    expect(moved).toBeGreaterThan(1e-2);
  });
});
