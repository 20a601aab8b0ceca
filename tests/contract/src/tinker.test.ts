import tar from "tar-stream";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type RunningServer, startServer } from "./harness.ts";
import { BASE, tinyModel as tinkerModel } from "./native-runs/fixtures.ts";
import { STORES } from "./pg.ts";
import { datumOf, HttpError, RequestFailed, TinkerClient } from "./tinker/client.ts";

/** A tar's entries by name. */
async function tarEntries(bytes: Uint8Array): Promise<Map<string, Buffer>> {
  const out = new Map<string, Buffer>();
  const extract = tar.extract();
  extract.on("entry", (header, stream, next) => {
    const chunks: Buffer[] = [];
    stream.on("data", (c: unknown) => {
      chunks.push(c as Buffer);
    });
    stream.on("end", () => {
      out.set(header.name, Buffer.concat(chunks));
      next();
    });
  });
  await new Promise<void>((resolve, reject) => {
    extract.on("finish", resolve);
    extract.on("error", reject);
    extract.end(Buffer.from(bytes));
  });
  return out;
}

/**
 * Tinker's API (ADR 71, docs/tinker.md) driven by our protobuf client as SDK 0.25 drives it:
 * the handshake, a LoRA training client as a native run, forward_backward (protobuf) and
 * optim_step through futures, on the shipped tiny model with the embedded worker.
 */
describe.each(STORES)("Tinker's API on $name", (store) => {
  let server: RunningServer;
  let tinker: TinkerClient;
  beforeAll(async () => {
    if (store.skip !== null) return;
    server = await startServer(
      {},
      { worker: true, ...(store.postgres ? { postgres: store.postgres } : {}) },
    );
    tinker = new TinkerClient(server.baseUrl, server.adminKey);
  });
  const test = it.skipIf(store.skip !== null);
  afterAll(async () => {
    await server?.close();
  });

  /** Reversal examples tokenized by the base model's chat template, one datum each. */
  const reversalData = async (words: readonly string[]) => {
    const { chat } = await tinkerModel();
    return words.map((word) => {
      const { tokens, mask } = chat.trainingTokens(
        [
          { role: "user", content: `Reverse the word: ${word}` },
          { role: "assistant", content: [...word].reverse().join("") },
        ],
        () => true,
      );
      return datumOf(tokens, [...mask]);
    });
  };

  describe("the handshake", () => {
    test("when the client config is asked with a tml- key, then every optional transport is off", async () => {
      const config = await tinker.json("POST", "client/config", { sdk_version: "0.25.0" });
      expect(config).toMatchObject({
        pjwt_auth_enabled: false,
        use_pyqwest_transport: false,
        parallel_fwdbwd_chunks: false,
        proto_compress_fwdbwd: false,
      });
      expect(await tinker.json("POST", "client/dynamic_config", {})).toMatchObject({
        refresh_interval_sec: expect.any(Number),
      });
    });

    test("when a session is made, heartbeats and telemetry are sent, then each is accepted", async () => {
      const { session_id } = await tinker.createSession();
      expect(session_id).toEqual(expect.any(String));
      expect(
        await tinker.json("POST", "session_heartbeat", { session_id, type: "session_heartbeat" }),
      ).toEqual({ type: "session_heartbeat" });
      expect(
        await tinker.json("POST", "telemetry", { events: [], session_id, sdk_version: "0.25.0" }),
      ).toEqual({ status: "accepted" });
    });

    test("when the capabilities are asked, then the served bases are listed with their context", async () => {
      const { supported_models } = await tinker.json<{
        supported_models: { model_name: string; max_context_length: number }[];
      }>("GET", "get_server_capabilities");
      expect(supported_models).toContainEqual({ model_name: BASE, max_context_length: 256 });
    });

    test("when the key is missing, unknown or another's, then the answer is 401 in the SDK's shape", async () => {
      const bad = new TinkerClient(server.baseUrl, "tml-not-a-key");
      const err = await bad.json("POST", "client/config", {}).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(HttpError);
      expect((err as HttpError).status).toBe(401);
      expect((err as HttpError).body).toEqual({ detail: expect.any(String) });
      const res = await fetch(`${server.baseUrl}/tinker/api/v1/client/config`, { method: "POST" });
      expect(res.status).toBe(401);
    });

    test("when a base model is not served, then create_model is 400 naming it", async () => {
      const { session_id } = await tinker.createSession();
      const err = await tinker
        .createModel(session_id, 0, "nobody/nothing", 4)
        .catch((e: unknown) => e);
      expect((err as HttpError).status).toBe(400);
      expect(JSON.stringify((err as HttpError).body)).toContain("nobody/nothing");
    });
  });

  describe("the training loop", () => {
    test("when a LoRA client trains by cross_entropy, then loss:sum falls over optimizer steps and logprobs have one value per target", async () => {
      const { session_id } = await tinker.createSession();
      const modelId = await tinker.createModel(session_id, 0, BASE, 4, 7);
      // The training client is a native run (ADR 71): the native API reads it.
      const run = await server.authorizedClient().training.runs.retrieve(modelId);
      expect(run.spec).toMatchObject({ base_model: BASE, lora_rank: 4 });

      const data = await reversalData(["apple", "stone", "river"]);
      const losses: number[] = [];
      let seq = 1;
      for (let step = 0; step < 4; step++) {
        const out = await tinker.forwardBackward(modelId, seq++, data, "cross_entropy");
        expect(out.logprobs.map((l) => l.length)).toEqual(data.map((d) => d.targetTokens.length));
        for (const l of out.logprobs) for (const v of l) expect(v).toBeLessThanOrEqual(0);
        // loss:sum is −Σ w·logprob, the logprobs' own sum.
        let expected = 0;
        out.logprobs.forEach((l, i) => {
          l.forEach((v, p) => {
            expected -= data[i]!.weights![p]! * v;
          });
        });
        expect(out.metrics["loss:sum"]).toBeCloseTo(expected, 2);
        losses.push(out.metrics["loss:sum"]!);
        const optim = await tinker.optimStep(modelId, seq++, { learning_rate: 1e-2 });
        expect(optim).toHaveProperty("metrics");
      }
      expect(losses[3]!).toBeLessThan(losses[0]!);

      // forward (forward_only) accumulates nothing: twice, the same logprobs.
      const a = await tinker.forwardBackward(modelId, seq++, data, "cross_entropy", {
        forwardOnly: true,
      });
      const b = await tinker.forwardBackward(modelId, seq++, data, "cross_entropy", {
        forwardOnly: true,
      });
      expect(a.metrics["loss:sum"]).toBeLessThan(losses[3]!);
      expect([...b.logprobs[0]!]).toEqual([...a.logprobs[0]!]);
      // An optim_step with no open gradient fails its future in the SDK's shape.
      const err = await tinker
        .optimStep(modelId, seq++, { learning_rate: 1e-2 })
        .catch((e: unknown) => e);
      // 400, not 409: the SDK retries a 409 for minutes.
      expect(err).toBeInstanceOf(HttpError);
      expect((err as HttpError).status).toBe(400);
    });

    test("when each RL loss is sent with its inputs and config, then loss:sum is its documented formula of the returned logprobs, and a step trains on it", async () => {
      const { session_id } = await tinker.createSession();
      const modelId = await tinker.createModel(session_id, 0, BASE, 4, 3);
      const [datum] = await reversalData(["lemon"]);
      let seq = 1;
      const { logprobs } = await tinker.forwardBackward(modelId, seq++, [datum!], "cross_entropy", {
        forwardOnly: true,
      });
      const lp0 = [...logprobs[0]!];
      // A sampler's logprobs off the learner's, advantages on the reply's positions only.
      const q = lp0.map((v, i) => v + 0.3 * Math.sin(i));
      const A = datum!.weights!.map((w, i) => (w > 0 ? (i % 3) - 1 : 0));
      const rl = { ...datum!, weights: undefined, logprobs: q, advantages: A };
      const sum = (f: (lp: number, q: number, a: number) => number) =>
        lp0.reduce((acc, lp, i) => acc + f(lp, q[i]!, A[i]!), 0);
      const clamp = (x: number, lo: number, hi: number) => Math.min(Math.max(x, lo), hi);
      const cases: [string, Record<string, number>, number][] = [
        ["importance_sampling", {}, sum((lp, q, a) => -Math.exp(lp - q) * a)],
        [
          "ppo",
          { clip_low_threshold: 0.9, clip_high_threshold: 1.1 },
          sum((lp, q, a) => -Math.min(Math.exp(lp - q) * a, clamp(Math.exp(lp - q), 0.9, 1.1) * a)),
        ],
        ["cispo", {}, sum((lp, q, a) => -clamp(Math.exp(lp - q), 0, 4) * lp * a)],
        ["dro", { beta: 0.1 }, sum((lp, q, a) => (a === 0 ? 0 : -(lp * a - 0.05 * (lp - q) ** 2)))],
      ];
      for (const [loss, config, expected] of cases) {
        const out = await tinker.forwardBackward(modelId, seq++, [rl], loss, {
          config,
          forwardOnly: true,
        });
        expect([...out.logprobs[0]!]).toEqual(lp0);
        expect(out.metrics["loss:sum"], loss).toBeCloseTo(expected, 3);
      }
      // A config key a loss does not take is refused.
      const bad = await tinker
        .submitForwardBackward(modelId, seq, [rl], "importance_sampling", { config: { beta: 1 } })
        .catch((e: unknown) => e);
      expect((bad as HttpError).status).toBe(400);
      await tinker.forwardBackward(modelId, seq++, [rl], "ppo");
      await tinker.optimStep(modelId, seq++, { learning_rate: 1e-3, grad_clip_norm: 1 });
      const moved = await tinker.forwardBackward(modelId, seq++, [datum!], "cross_entropy", {
        forwardOnly: true,
      });
      expect([...moved.logprobs[0]!]).not.toEqual(lp0);
    });

    test("when several requests are submitted before any result is read, then their futures are read together, each with its own result, in the run's order", async () => {
      const { session_id } = await tinker.createSession();
      const modelId = await tinker.createModel(session_id, 0, BASE, 4, 9);
      const data = await reversalData(["apple", "stone"]);
      const f1 = await tinker.submitForwardBackward(modelId, 1, data, "cross_entropy");
      const f2 = await tinker.submitForwardBackward(modelId, 2, data.slice(0, 1), "cross_entropy");
      const f3 = await tinker.json<{ request_id: string }>("POST", "optim_step", {
        adam_params: { learning_rate: 1e-2 },
        model_id: modelId,
        seq_id: 3,
      });
      const f4 = await tinker.submitForwardBackward(modelId, 4, data, "cross_entropy", {
        forwardOnly: true,
      });
      const [r1, r2, r3, r4] = await Promise.all([
        tinker.forwardBackwardResult(f1),
        tinker.forwardBackwardResult(f2),
        tinker.result(f3),
        tinker.forwardBackwardResult(f4),
      ]);
      expect(r1.logprobs).toHaveLength(2);
      expect(r2.logprobs).toHaveLength(1);
      // The second saw the same learner as the first; the forward after the step sees a new one.
      expect([...r2.logprobs[0]!]).toEqual([...r1.logprobs[0]!]);
      expect(r3).toHaveProperty("metrics");
      expect(r4.metrics["loss:sum"]).toBeLessThan(r1.metrics["loss:sum"]!);
    });

    test("when a request is sent again with its seq_id, then the same future answers", async () => {
      const { session_id } = await tinker.createSession();
      const modelId = await tinker.createModel(session_id, 0, BASE, 4);
      const data = await reversalData(["moon"]);
      const first = await tinker.submitForwardBackward(modelId, 1, data, "cross_entropy");
      const again = await tinker.submitForwardBackward(modelId, 1, data, "cross_entropy");
      expect(again.request_id).toBe(first.request_id);
      const out = await tinker.forwardBackwardResult(first);
      expect(out.logprobs).toHaveLength(1);
      // Other content under a seq_id already taken is refused.
      const other = await tinker
        .submitForwardBackward(modelId, 1, await reversalData(["star"]), "cross_entropy")
        .catch((e: unknown) => e);
      expect((other as HttpError).status).toBe(400);
    });

    test("when a datum is malformed, then forward_backward is 400 saying what is wrong", async () => {
      const { session_id } = await tinker.createSession();
      const modelId = await tinker.createModel(session_id, 0, BASE, 4);
      const [datum] = await reversalData(["sun"]);
      const short = { ...datum!, targetTokens: datum!.targetTokens.slice(1) };
      const err = await tinker
        .submitForwardBackward(modelId, 1, [short], "cross_entropy")
        .catch((e: unknown) => e);
      expect((err as HttpError).status).toBe(400);
      expect(JSON.stringify((err as HttpError).body)).toContain("target_tokens");
      const unknown = await tinker
        .submitForwardBackward(modelId, 1, [datum!], "hinge")
        .catch((e: unknown) => e);
      expect((unknown as HttpError).status).toBe(400);
      const missing = await tinker
        .submitForwardBackward(modelId, 1, [datum!], "ppo")
        .catch((e: unknown) => e);
      expect(JSON.stringify((missing as HttpError).body)).toContain("logprobs, which ppo needs");
    });

    test("when another tenant asks for a run's future or trains it, then it is not found", async () => {
      const { session_id } = await tinker.createSession();
      const modelId = await tinker.createModel(session_id, 0, BASE, 4);
      const other = await server.newTenant("tinker-other");
      const stranger = new TinkerClient(server.baseUrl, other.apiKey);
      const err = await stranger
        .optimStep(modelId, 1, { learning_rate: 1e-3 })
        .catch((e: unknown) => e);
      expect((err as HttpError).status).toBe(404);
      const future = await stranger
        .result({ request_id: `model.${modelId}` })
        .catch((e: unknown) => e);
      expect((future as HttpError).status).toBe(404);
    });
  });

  describe("sampling", () => {
    /** A trained client: two steps of cross_entropy on reversal examples. */
    const trained = async () => {
      const { session_id } = await tinker.createSession();
      const modelId = await tinker.createModel(session_id, 0, BASE, 4, 11);
      const data = await reversalData(["apple", "stone"]);
      let seq = 1;
      for (let step = 0; step < 2; step++) {
        await tinker.forwardBackward(modelId, seq++, data, "cross_entropy");
        await tinker.optimStep(modelId, seq++, { learning_rate: 1e-2 });
      }
      return { session_id, modelId, seq };
    };
    const promptTokens = async (word: string) => {
      const { chat } = await tinkerModel();
      return chat.encode([{ role: "user", content: `Reverse the word: ${word}` }], {
        addGenerationPrompt: true,
      });
    };

    test("when named sampler weights are saved, then they sample with per-token logprobs that a forward of the same tokens gives, and chat serves them", async () => {
      const { session_id, modelId, seq } = await trained();
      const saved = await tinker.result<{ path: string }>(
        await tinker.json("POST", "save_weights_for_sampler", {
          model_id: modelId,
          path: "final",
          seq_id: seq,
          type: "save_weights_for_sampler",
        }),
      );
      expect(saved.path).toBe(`tinker://${modelId}/sampler_weights/final`);
      const { sampling_session_id } = await tinker.json<{ sampling_session_id: string }>(
        "POST",
        "create_sampling_session",
        { session_id, sampling_session_seq_id: 0, model_path: saved.path },
      );
      const sampler = await tinker.json("GET", `samplers/${sampling_session_id}`);
      expect(sampler).toMatchObject({ sampler_id: sampling_session_id, base_model: BASE });

      const { chat } = await tinkerModel();
      const stop = [...chat.stopIds];
      const prompt = await promptTokens("apple");
      const future = await tinker.json<{ request_id: string; sample_sequence_ids: string[] }>(
        "POST",
        "asample",
        {
          num_samples: 2,
          prompt: { chunks: [{ tokens: prompt, type: "encoded_text" }] },
          sampling_params: { max_tokens: 12, seed: 3, temperature: 1, top_k: -1, top_p: 1, stop },
          sampling_session_id,
          seq_id: 1,
          prompt_logprobs: false,
          topk_prompt_logprobs: 0,
          type: "sample",
        },
      );
      expect(future.sample_sequence_ids).toHaveLength(2);
      const sampled = await tinker.sampleResult(future);
      expect(sampled.sequences).toHaveLength(2);
      for (const s of sampled.sequences) {
        expect(s.tokens.length).toBeGreaterThan(0);
        expect(s.logprobs).toHaveLength(s.tokens.length);
        // A sequence that stopped ends with its stop token, as Tinker's do.
        if (s.stopReason === "stop") expect(stop).toContain(s.tokens.at(-1));
        else expect(s.tokens).toHaveLength(12);
      }

      // compute_logprobs: the prompt and a sequence, one token sampled, prompt_logprobs on.
      const first = sampled.sequences[0]!;
      const whole = [...prompt, ...first.tokens];
      const scored = await tinker.sampleResult(
        await tinker.json<{ request_id: string }>("POST", "asample", {
          num_samples: 1,
          prompt: { chunks: [{ tokens: whole, type: "encoded_text" }] },
          sampling_params: { max_tokens: 1, temperature: 1 },
          sampling_session_id,
          prompt_logprobs: true,
          topk_prompt_logprobs: 0,
        }),
      );
      expect(scored.promptLogprobs).toHaveLength(whole.length);
      expect(scored.promptLogprobs![0]).toBeNull();
      first.logprobs.forEach((lp, j) => {
        expect(scored.promptLogprobs![prompt.length + j]).toBeCloseTo(lp, 4);
      });
      // The learner's own forward of the same tokens agrees: the sampler is the learner.
      const forward = await tinker.forwardBackward(
        modelId,
        seq + 1,
        [
          {
            tokens: whole.slice(0, -1),
            targetTokens: whole.slice(1),
            weights: whole.slice(1).map(() => 0),
          },
        ],
        "cross_entropy",
        { forwardOnly: true },
      );
      first.logprobs.forEach((lp, j) => {
        expect(forward.logprobs[0]![prompt.length - 1 + j]).toBeCloseTo(lp, 3);
      });

      // The sampler path is a checkpoint of the run's model, and chat serves it.
      const client = server.authorizedClient();
      const completion = await client.chat.completions.create({
        model: `default/tinker/run-${modelId}:step2`,
        messages: [{ role: "user", content: "Reverse the word: apple" }],
        max_tokens: 4,
        temperature: 0,
        logprobs: true,
      });
      expect(completion.choices[0]!.logprobs!.content!.length).toBeGreaterThan(0);
    });

    test("when weights are saved for a sampler without a name, then the sampling session comes back at once and samples; stop strings end a sequence", async () => {
      const { modelId, seq } = await trained();
      const { sampling_session_id } = await tinker.result<{ sampling_session_id: string }>(
        await tinker.json("POST", "save_weights_for_sampler", {
          model_id: modelId,
          sampling_session_seq_id: 0,
          seq_id: seq,
          type: "save_weights_for_sampler",
        }),
      );
      expect(sampling_session_id).toEqual(expect.any(String));
      const { chat } = await tinkerModel();
      const prompt = await promptTokens("stone");
      const greedy = (stop?: string) =>
        tinker
          .json<{ request_id: string }>("POST", "asample", {
            num_samples: 1,
            prompt: { chunks: [{ tokens: prompt, type: "encoded_text" }] },
            sampling_params: { max_tokens: 12, temperature: 0, ...(stop ? { stop } : {}) },
            sampling_session_id,
          })
          .then((f) => tinker.sampleResult(f));
      const free = (await greedy()).sequences[0]!;
      // A stop string from the free reply's text: the reply ends at the token that completes it.
      const texts = free.tokens.map((_, i) => chat.tokenizer.decode(free.tokens.slice(0, i + 1)));
      const at = texts.findIndex((t) => t.trim().length > 0);
      expect(at).toBeGreaterThanOrEqual(0);
      const stop = texts[at]!.trim().slice(-1);
      const end = texts.findIndex((t) => t.includes(stop));
      const out = await greedy(stop);
      const [s] = out.sequences;
      expect(s!.stopReason).toBe("stop");
      expect(s!.tokens).toEqual(free.tokens.slice(0, end + 1));
      expect(s!.logprobs).toEqual(free.logprobs.slice(0, end + 1));
      expect(out.promptLogprobs).toBeNull();

      // A base model samples too.
      const base = await tinker.json<{ sampling_session_id: string }>(
        "POST",
        "create_sampling_session",
        { session_id: "s", sampling_session_seq_id: 1, base_model: BASE },
      );
      const fromBase = await tinker.sampleResult(
        await tinker.json<{ request_id: string }>("POST", "asample", {
          num_samples: 1,
          prompt: { chunks: [{ tokens: prompt, type: "encoded_text" }] },
          sampling_params: { max_tokens: 3, seed: 1, temperature: 1 },
          sampling_session_id: base.sampling_session_id,
        }),
      );
      expect(fromBase.sequences[0]!.logprobs).toHaveLength(fromBase.sequences[0]!.tokens.length);
    });
  });

  describe("state and the REST client's routes", () => {
    const save = async (modelId: string, seq: number, name: string) =>
      tinker.result<{ path: string }>(
        await tinker.json("POST", "save_weights", {
          model_id: modelId,
          path: name,
          seq_id: seq,
          type: "save_weights",
        }),
      );

    test("when a state is saved and a client is made from it, then it computes the same logprobs; runs, checkpoints and archives list and delete", async () => {
      const { session_id } = await tinker.createSession();
      const modelId = await tinker.createModel(session_id, 0, BASE, 4, 5);
      const data = await reversalData(["apple", "river"]);
      let seq = 1;
      await tinker.forwardBackward(modelId, seq++, data, "cross_entropy");
      await tinker.optimStep(modelId, seq++, { learning_rate: 1e-2 });
      const { path } = await save(modelId, seq++, "ckpt-1");
      expect(path).toBe(`tinker://${modelId}/weights/ckpt-1`);
      // A name saved again without overwrite fails its future, in the SDK's shape.
      const again = await save(modelId, seq++, "ckpt-1").catch((e: unknown) => e);
      expect(again).toBeInstanceOf(RequestFailed);
      expect((again as RequestFailed).category).toBe("user");
      const before = await tinker.forwardBackward(modelId, seq++, data, "cross_entropy", {
        forwardOnly: true,
      });

      // create_training_client_from_state: weights_info, create_model, load_weights.
      const info = await tinker.json<Record<string, unknown>>("POST", "weights_info", {
        tinker_path: path,
      });
      expect(info).toEqual({
        base_model: BASE,
        is_lora: true,
        lora_rank: 4,
        train_unembed: true,
        train_mlp: true,
        train_attn: true,
      });
      const resumed = await tinker.createModel(session_id, 1, BASE, 4);
      await tinker.result(
        await tinker.json("POST", "load_weights", {
          model_id: resumed,
          path,
          seq_id: 1,
          optimizer: true,
          type: "load_weights",
        }),
      );
      const after = await tinker.forwardBackward(resumed, 2, data, "cross_entropy", {
        forwardOnly: true,
      });
      expect([...after.logprobs[1]!]).toEqual([...before.logprobs[1]!]);
      // It trains on from there, the optimizer's moments restored.
      await tinker.forwardBackward(resumed, 3, data, "cross_entropy");
      await tinker.optimStep(resumed, 4, { learning_rate: 1e-2 });

      const sampler = await tinker.result<{ path: string }>(
        await tinker.json("POST", "save_weights_for_sampler", {
          model_id: modelId,
          path: "s-1",
          seq_id: seq++,
        }),
      );
      const runs = await tinker.json<{
        training_runs: { training_run_id: string; last_checkpoint: unknown }[];
        cursor: { total_count: number };
      }>("GET", "training_runs?limit=100&offset=0&access_scope=owned");
      expect(runs.training_runs.map((r) => r.training_run_id)).toEqual(
        expect.arrayContaining([modelId, resumed]),
      );
      const run = await tinker.json<Record<string, unknown>>("GET", `training_runs/${modelId}`);
      expect(run).toMatchObject({
        training_run_id: modelId,
        base_model: BASE,
        is_lora: true,
        lora_rank: 4,
        corrupted: false,
        last_checkpoint: { checkpoint_id: "weights/ckpt-1", tinker_path: path },
        last_sampler_checkpoint: {
          checkpoint_id: "sampler_weights/s-1",
          tinker_path: sampler.path,
        },
      });
      const listed = await tinker.json<{ checkpoints: { checkpoint_id: string }[] }>(
        "GET",
        `training_runs/${modelId}/checkpoints`,
      );
      expect(listed.checkpoints.map((c) => c.checkpoint_id)).toEqual([
        "weights/ckpt-1",
        "sampler_weights/s-1",
      ]);

      // The archive is a PEFT tar of the adapter, fetched bare from the URL handed out.
      for (const id of ["weights/ckpt-1", "sampler_weights/s-1"]) {
        const { url, expires } = await tinker.json<{ url: string; expires: string }>(
          "GET",
          `training_runs/${modelId}/checkpoints/${id}/archive`,
        );
        expect(Date.parse(expires)).toBeGreaterThan(Date.now());
        const res = await fetch(url);
        expect(res.status).toBe(200);
        // At the archive's root, with the marker the SDK's download checks for.
        const entries = await tarEntries(new Uint8Array(await res.arrayBuffer()));
        expect([...entries.keys()].sort()).toEqual([
          "adapter_config.json",
          "adapter_model.safetensors",
          "checkpoint_complete",
        ]);
        expect(JSON.parse(entries.get("adapter_config.json")!.toString("utf8"))).toMatchObject({
          r: 4,
          peft_type: "LORA",
        });
      }

      // A deleted state is gone: listed no more, loaded no more.
      const del = await fetch(
        `${server.baseUrl}/tinker/api/v1/training_runs/${modelId}/checkpoints/weights%2Fckpt-1`,
        { method: "DELETE", headers: { "x-api-key": `tml-${server.adminKey}` } },
      );
      expect(del.status).toBe(204);
      const left = await tinker.json<{ checkpoints: { checkpoint_id: string }[] }>(
        "GET",
        `training_runs/${modelId}/checkpoints`,
      );
      expect(left.checkpoints.map((c) => c.checkpoint_id)).toEqual(["sampler_weights/s-1"]);
      // A second sampler save with no step between is the same weights: deleting either name
      // would take the other's, so it is refused (400, which the SDK raises at once), naming it.
      await tinker.result(
        await tinker.json("POST", "save_weights_for_sampler", {
          model_id: modelId,
          path: "s-2",
          seq_id: seq++,
        }),
      );
      const shared = await fetch(
        `${server.baseUrl}/tinker/api/v1/training_runs/${modelId}/checkpoints/sampler_weights%2Fs-1`,
        { method: "DELETE", headers: { "x-api-key": `tml-${server.adminKey}` } },
      );
      expect(shared.status).toBe(400);
      expect(((await shared.json()) as { detail: string }).detail).toMatch(/sampler_weights\/s-2/);
      const gone = await tinker
        .json("POST", "load_weights", { model_id: resumed, path, seq_id: 5, optimizer: false })
        .catch((e: unknown) => e);
      expect((gone as HttpError).status).toBe(404);
    });
  });

  // The long-poll is the router's alone: once, on SQLite.
  describe.skipIf(store.name !== "SQLite")("retrieve_future without a worker", () => {
    let idle: RunningServer;
    beforeAll(async () => {
      idle = await startServer({}, { worker: false });
    });
    afterAll(async () => {
      await idle?.close();
    });

    test("when an operation cannot run yet, then retrieve_future waits and answers try_again with the request id, which the client polls again", async () => {
      const client = new TinkerClient(idle.baseUrl, idle.adminKey);
      const { session_id } = await client.createSession();
      const modelId = await client.createModel(session_id, 0, BASE, 4);
      const [datum] = await reversalData(["sun"]);
      const future = await client.submitForwardBackward(modelId, 1, [datum!], "cross_entropy");
      const answer = await client.json<Record<string, unknown>>("POST", "retrieve_future", {
        request_id: future.request_id,
        allow_metadata_only: true,
      });
      expect(answer).toEqual({
        type: "try_again",
        request_id: future.request_id,
        queue_state: "active",
      });
      const unknown = await client
        .json("POST", "retrieve_future", { request_id: "op.nothing.here" })
        .catch((e: unknown) => e);
      expect((unknown as HttpError).status).toBe(404);
    });
  });
});
