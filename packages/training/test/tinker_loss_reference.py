"""Tinker's losses in PyTorch, as its documentation defines them (docs/tinker.md, ADR 71):
token-wise sums over a datum, minimised. Reads {"cases": [{loss, lp, q, A, w, config}]} as JSON
on stdin and writes [{loss, grad}] (grad: d loss / d lp, by autograd) as JSON on stdout.
Run by packages/training/test/tinker-losses.test.ts with Debian's python3-torch."""
import json
import sys

import torch


def loss_of(case, lp):
    q = torch.tensor(case["q"], dtype=torch.float64)
    a = torch.tensor(case["A"], dtype=torch.float64)
    w = torch.tensor(case["w"], dtype=torch.float64)
    cfg = case["config"]
    name = case["loss"]
    if name == "cross_entropy":
        return -(w * lp).sum()
    ratio = torch.exp(lp - q)
    if name == "importance_sampling":
        return -(ratio * a).sum()
    if name == "ppo":
        lo = cfg.get("clip_low_threshold", 0.8)
        hi = cfg.get("clip_high_threshold", 1.2)
        clipped = torch.clamp(ratio, lo, hi)
        return -torch.minimum(ratio * a, clipped * a).sum()
    if name == "cispo":
        lo = cfg.get("clip_low_threshold", 0.0)
        hi = cfg.get("clip_high_threshold", 4.0)
        clipped = torch.clamp(ratio, lo, hi).detach()
        return -(clipped * lp * a).sum()
    if name == "dro":
        beta = cfg.get("beta", 0.05)
        # Positions without advantage (a prompt's) bear no loss (docs/tinker.md).
        mask = (a != 0).to(torch.float64)
        return -(mask * (lp * a - 0.5 * beta * (lp - q) ** 2)).sum()
    raise ValueError(name)


out = []
for case in json.load(sys.stdin)["cases"]:
    lp = torch.tensor(case["lp"], dtype=torch.float64, requires_grad=True)
    loss = loss_of(case, lp)
    loss.backward()
    out.append({"loss": loss.item(), "grad": lp.grad.tolist()})
json.dump(out, sys.stdout)
