/**
 * Training throughput of @arbor/engine on one thread (forward + backward + AdamW), on the
 * shipped tiny-chat shape, against PyTorch on the same shape when it is installed.
 * Usage: node bench/engine-training.ts [batch=32] [seqLen=128]
 *
 * For the PyTorch comparison: apt-get install python3-torch libopenblas0-pthread
 * (the script pins PyTorch to one thread: torch.set_num_threads(1), OMP/OPENBLAS=1).
 */
import { execFileSync, spawnSync } from "node:child_process";
import { readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  catalogModelDir,
  createModel,
  defaultKernels,
  initWeights,
  parameterCount,
  parseConfig,
  Rng,
  Tokenizer,
  Trainer,
} from "../packages/engine/src/index.ts";

const B = Number(process.argv[2] ?? 32);
const T = Number(process.argv[3] ?? 128);
const STEPS = 5;

const dir = catalogModelDir("arbor/tiny-chat");
const config = parseConfig(JSON.parse(readFileSync(join(dir, "config.json"), "utf8")));
const tokenizer = Tokenizer.fromJson(JSON.parse(readFileSync(join(dir, "tokenizer.json"), "utf8")));
const model = createModel(config, initWeights(config, 1), tokenizer);
const kernels = defaultKernels();
const trainer = new Trainer(model, kernels, {
  schedule: { kind: "constant", peak: 1e-3, warmupSteps: 0, totalSteps: STEPS + 1 },
});
const rng = new Rng(1);
const inputs = Int32Array.from({ length: B * T }, () => rng.int(config.vocabSize));
const targets = Int32Array.from({ length: B * T }, () => rng.int(config.vocabSize));
const batch = {
  batchSize: B,
  seqLen: T,
  inputs,
  targets,
  lossMask: new Float32Array(B * T).fill(1),
};
trainer.step(batch); // warm-up
// The machine is shared: report the fastest step (the least disturbed), as tokens/s.
let ours = 0;
for (let i = 0; i < STEPS; i++) {
  const start = performance.now();
  trainer.step(batch);
  ours = Math.max(ours, (B * T) / ((performance.now() - start) / 1000));
}

const PYTORCH = `
import json, sys, time, os
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
c = json.load(open(sys.argv[1]))
B, T, STEPS = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
D, I, L, H, KV = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]
hd, V, eps, theta = c["head_dim"], c["vocab_size"], c["rms_norm_eps"], c["rope_theta"]
class Norm(torch.nn.Module):
    def __init__(s): super().__init__(); s.w = torch.nn.Parameter(torch.ones(D))
    def forward(s, x): return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * s.w
inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
ang = torch.outer(torch.arange(T).float(), inv)
cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
def rot(x): h = x.shape[-1] // 2; return torch.cat([-x[..., h:], x[..., :h]], -1)
class Block(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.n1, s.n2 = Norm(), Norm()
        s.q, s.k, s.v = torch.nn.Linear(D, H*hd, bias=False), torch.nn.Linear(D, KV*hd, bias=False), torch.nn.Linear(D, KV*hd, bias=False)
        s.o = torch.nn.Linear(H*hd, D, bias=False)
        s.g, s.u, s.d = torch.nn.Linear(D, I, bias=False), torch.nn.Linear(D, I, bias=False), torch.nn.Linear(I, D, bias=False)
    def forward(s, x):
        b, t, _ = x.shape
        h = s.n1(x)
        q = s.q(h).view(b, t, H, hd).transpose(1, 2)
        k = s.k(h).view(b, t, KV, hd).transpose(1, 2)
        v = s.v(h).view(b, t, KV, hd).transpose(1, 2)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        kk, vv = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
            a = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        else:  # PyTorch < 2.0 (Debian bookworm's python3-torch is 1.13)
            sc = (q @ kk.transpose(-1, -2)) / hd ** 0.5
            a = torch.softmax(sc.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")), -1) @ vv
        x = x + s.o(a.transpose(1, 2).reshape(b, t, H*hd))
        h = s.n2(x)
        return x + s.d(torch.nn.functional.silu(s.g(h)) * s.u(h))
class Model(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = torch.nn.Embedding(V, D)
        s.blocks = torch.nn.ModuleList([Block() for _ in range(L)])
        s.norm = Norm()
    def forward(s, x):
        x = s.emb(x)
        for blk in s.blocks: x = blk(x)
        return s.norm(x) @ s.emb.weight.T
m = Model()
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
x = torch.randint(0, V, (B, T)); y = torch.randint(0, V, (B, T))
def step():
    loss = torch.nn.functional.cross_entropy(m(x).view(-1, V), y.view(-1))
    opt.zero_grad(); loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step()
step()
best = 0.0
for _ in range(STEPS):
    t0 = time.perf_counter(); step()
    best = max(best, B * T / (time.perf_counter() - t0))
print(json.dumps({"tokens_per_s": best, "parameters": sum(p.numel() for p in m.parameters())}))
`;

let torch: { tokens_per_s: number; parameters: number } | null = null;
if (spawnSync("/usr/bin/python3", ["-c", "import torch"]).status === 0) {
  const script = join(tmpdir(), "arbor-bench-torch-train.py");
  writeFileSync(script, PYTORCH);
  const output = execFileSync(
    "/usr/bin/python3",
    [script, join(dir, "config.json"), String(B), String(T), String(STEPS)],
    {
      env: {
        ...process.env,
        OMP_NUM_THREADS: "1",
        OPENBLAS_NUM_THREADS: "1",
        MKL_NUM_THREADS: "1",
      },
    },
  );
  torch = JSON.parse(output.toString()) as { tokens_per_s: number; parameters: number };
}

console.log(`\n@arbor/engine training, tiny-chat shape, ${parameterCount(model)} parameters`);
console.log(`batch ${B} × ${T} tokens, kernels ${kernels.name}, one thread\n`);
if (torch) {
  console.log("| engine tok/s | PyTorch tok/s | engine / PyTorch |");
  console.log("|---:|---:|---:|");
  console.log(
    `| ${ours.toFixed(0)} | ${torch.tokens_per_s.toFixed(0)} | ${(ours / torch.tokens_per_s).toFixed(2)} |`,
  );
} else {
  console.log("| engine tok/s |\n|---:|");
  console.log(`| ${ours.toFixed(0)} |`);
  console.log(
    "\nPyTorch not found: `apt-get install python3-torch libopenblas0-pthread` to compare (run on one thread).",
  );
}
