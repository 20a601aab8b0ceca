"""A PyTorch reference of the decoder families the engine serves, written from the Hugging Face
definitions (Llama 3.x with llama3 RoPE scaling, Qwen2 with q/k/v biases, Qwen3 with per-head
q/k RMSNorm, SmolLM3 with NoPE layers), for the engine's correctness tests.

Usage: python3 torch_reference.py MODEL_DIR < request.json > answer.json
The request: {"prompts": [[ids...], ...], "greedy": N, "adapter": {"dir"} | null,
"lora": {"dir"} | null, "batch": {...} | null, "dpo": {...} | null}; "adapter" applies a PEFT
folder to every answer, "lora" only to the loss and gradients of "batch".
"dpo": {"lora": dir, "reference": dir | null, "beta": b, "pairs": [{"chosen": seq,
"rejected": seq}]}, each seq {"inputs", "targets", "mask"}: the DPO loss (mean over the pairs of
-log sigmoid(b * ((pi_c - ref_c) - (pi_r - ref_r))), pi the masked sum of a sequence's target
log-probs with the "lora" adapter, ref with the "reference" adapter or (null) the base alone) and
its gradients with respect to the "lora" adapter's tensors.
The answer: {"last_logits": [[...], ...], "greedy": [ids...], "loss": x, "grads": {name: [...]},
"dpo": {"loss": x, "grads": {name: [...]}, "chosen_rewards": [...], "rejected_rewards": [...]}}
"""
import json
import math
import os
import struct
import sys

import numpy as np
import torch

torch.set_num_threads(int(os.environ.get("TORCH_THREADS", "1")))
torch.set_default_dtype(torch.float32)


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    base = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        raw = data[base + start : base + end]
        if entry["dtype"] == "F32":
            array = np.frombuffer(raw, dtype="<f4").copy()
        elif entry["dtype"] == "BF16":
            array = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"dtype {entry['dtype']}")
        tensors[name] = torch.from_numpy(array.reshape(entry["shape"]).copy())
    return tensors


class Reference:
    def __init__(self, folder):
        with open(os.path.join(folder, "config.json")) as f:
            self.c = json.load(f)
        self.w = read_safetensors(os.path.join(folder, "model.safetensors"))
        c = self.c
        self.type = c.get("model_type", "llama")
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads", self.heads)
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.layers = c["num_hidden_layers"]
        self.inv_freq = self.frequencies()
        if self.type == "smollm3":
            interval = c.get("no_rope_layer_interval", 4)
            self.rope_layers = c.get("no_rope_layers") or [
                int((i + 1) % interval != 0) for i in range(self.layers)
            ]
        else:
            self.rope_layers = [1] * self.layers
        self.lora = {}
        self.lora_scale = 0.0

    def frequencies(self):
        c = self.c
        theta = c.get("rope_theta", 10000.0)
        inv = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        s = c.get("rope_scaling")
        if s and s.get("rope_type", s.get("type")) == "llama3":
            factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
            old = s["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old / low, inv / factor, inv)
            smooth = (old / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < old / high) & ~(wavelen > old / low)
            inv = torch.where(medium, smoothed, scaled)
        return inv.to(torch.float32)

    def norm(self, x, weight):
        variance = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + self.eps))

    def linear(self, x, name, layer):
        prefix = f"model.layers.{layer}"
        group = "mlp" if name in ("gate", "up", "down") else "self_attn"
        key = f"{prefix}.{group}.{name}_proj"
        y = x @ self.w[f"{key}.weight"].T
        if f"{key}.bias" in self.w:
            y = y + self.w[f"{key}.bias"]
        if key in self.lora:
            a, b = self.lora[key]
            y = y + (x @ a.T) @ b.T * self.lora_scale
        return y

    def rope(self, x, positions):
        angles = positions[:, None].to(torch.float32) * self.inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def load_lora(self, folder):
        """Reads a PEFT adapter folder by PEFT's tensor names; returns the tensors by name."""
        tensors = read_safetensors(os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json")) as f:
            config = json.load(f)
        self.lora_scale = config["lora_alpha"] / config["r"]
        for name, tensor in tensors.items():
            key = name.replace("base_model.model.", "").rsplit(".lora_", 1)[0]
            pair = self.lora.setdefault(key, [None, None])
            pair[0 if ".lora_A." in name else 1] = tensor
        return tensors

    def forward(self, ids):
        """Logits at every position of one sequence."""
        t = len(ids)
        x = self.w["model.embed_tokens.weight"][torch.tensor(ids)]
        positions = torch.arange(t)
        mask = torch.full((t, t), float("-inf")).triu(1)
        for layer in range(self.layers):
            p = f"model.layers.{layer}"
            h = self.norm(x, self.w[f"{p}.input_layernorm.weight"])
            q = self.linear(h, "q", layer).view(t, self.heads, self.head_dim)
            k = self.linear(h, "k", layer).view(t, self.kv_heads, self.head_dim)
            v = self.linear(h, "v", layer).view(t, self.kv_heads, self.head_dim)
            if self.type == "qwen3":
                q = self.norm(q, self.w[f"{p}.self_attn.q_norm.weight"])
                k = self.norm(k, self.w[f"{p}.self_attn.k_norm.weight"])
            if self.rope_layers[layer]:
                q, k = self.rope(q, positions), self.rope(k, positions)
            groups = self.heads // self.kv_heads
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim) + mask
            att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
            x = x + self.linear(att, "o", layer)
            h = self.norm(x, self.w[f"{p}.post_attention_layernorm.weight"])
            mlp = torch.nn.functional.silu(self.linear(h, "gate", layer)) * self.linear(h, "up", layer)
            x = x + self.linear(mlp, "down", layer)
        x = self.norm(x, self.w["model.norm.weight"])
        head = self.w["model.embed_tokens.weight"] if self.c.get("tie_word_embeddings") else self.w["lm_head.weight"]
        logits = x @ head.T
        if "lm_head" in self.lora:
            # PEFT's LoRA on the head's forward (the input embedding is left alone, tied or not).
            a, b = self.lora["lm_head"]
            logits = logits + (x @ a.T) @ b.T * self.lora_scale
        return logits


def main():
    folder = sys.argv[1]
    request = json.load(sys.stdin)
    ref = Reference(folder)
    answer = {}
    if request.get("adapter"):
        # A PEFT adapter served with the base: every answer below has it applied.
        ref.load_lora(request["adapter"]["dir"])
    with torch.no_grad():
        answer["last_logits"] = [ref.forward(ids)[-1].tolist() for ids in request["prompts"]]
        if request.get("greedy"):
            ids = list(request["prompts"][0])
            out = []
            for _ in range(request["greedy"]):
                token = int(ref.forward(ids)[-1].argmax())
                out.append(token)
                ids.append(token)
            answer["greedy"] = out
    lora = request.get("lora")
    if lora:
        params = ref.load_lora(lora["dir"])
        for tensor in params.values():
            tensor.requires_grad_(True)
        total = 0.0
        weight = 0.0
        for seq in request["batch"]:
            logits = ref.forward(seq["inputs"])
            logp = logits.log_softmax(-1)[torch.arange(len(seq["targets"])), torch.tensor(seq["targets"])]
            m = torch.tensor(seq["mask"], dtype=torch.float32)
            total = total - (logp * m).sum()
            weight += float(m.sum())
        loss = total / weight
        loss.backward()
        answer["loss"] = float(loss)
        answer["grads"] = {name: t.grad.flatten().tolist() for name, t in params.items()}
    if request.get("dpo"):
        answer["dpo"] = dpo(folder, request["dpo"])
    json.dump(answer, sys.stdout)


def sequence_logp(model, seq):
    """The masked sum of a sequence's target log-probabilities."""
    logits = model.forward(seq["inputs"])
    logp = logits.log_softmax(-1)[torch.arange(len(seq["targets"])), torch.tensor(seq["targets"])]
    return (logp * torch.tensor(seq["mask"], dtype=torch.float32)).sum()


def dpo(folder, request):
    """The DPO loss of the pairs, the policy's adapter trained, the reference frozen."""
    reference = Reference(folder)
    if request.get("reference"):
        reference.load_lora(request["reference"])
    policy = Reference(folder)
    params = policy.load_lora(request["lora"])
    for tensor in params.values():
        tensor.requires_grad_(True)
    beta = request["beta"]
    losses, chosen, rejected = [], [], []
    for pair in request["pairs"]:
        with torch.no_grad():
            ref_c = sequence_logp(reference, pair["chosen"])
            ref_r = sequence_logp(reference, pair["rejected"])
        reward_c = beta * (sequence_logp(policy, pair["chosen"]) - ref_c)
        reward_r = beta * (sequence_logp(policy, pair["rejected"]) - ref_r)
        losses.append(-torch.nn.functional.logsigmoid(reward_c - reward_r))
        chosen.append(float(reward_c))
        rejected.append(float(reward_r))
    loss = torch.stack(losses).mean()
    loss.backward()
    return {
        "loss": float(loss),
        "grads": {name: t.grad.flatten().tolist() for name, t in params.items()},
        "chosen_rewards": chosen,
        "rejected_rewards": rejected,
    }


main()
