"""tetrad's tensor parallelism against torch's own (`parallelize_module` with ColwiseParallel /
RowwiseParallel / SequenceParallel and `loss_parallel`, DTensor), side by side in one run.

The same model (a Llama block stack: RMSNorm, RoPE, causal attention, SwiGLU, untied head), the
same initial weights (tetrad's layout-independent init is copied into the torch model), the same
batch and the same ranks (forked gloo processes). A step is forward, backward (plus, for tetrad
under SP, the replicated-gradient reduction torch does inside DTensor) and an AdamW update.

Step time: the median over the timed steps, max over ranks; the machine may be shared, so the
two frameworks alternate for `--repeats` rounds and each keeps its best round. Peak memory: torch's CPU allocator
keeps no statistics and tracemalloc does not see its allocations, so this measures the resident
set: the rise of the process's peak RSS (`ru_maxrss`) from just before the first step (model and
optimizer built, Adam states not yet allocated) to the end, max over ranks. That rise is the
training-time peak: activations kept for backward, gradients, Adam states, communication
buffers. Each (framework, SP) pair runs in fresh processes so one peak cannot hide another.
The SP "regather" row is tetrad with `parallel.sp_regather` (the column-parallel inputs gathered
again in backward instead of kept) against the same torch SP run (torch has no such choice).

    python bench/bench_tp.py                 # tp=2, d_model 512, 4 layers, seq 256, batch 4
    python bench/bench_tp.py --tp 2 --d-model 768 --layers 4
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from tetrad import launch
from tetrad.config import load_config
from tetrad.model.rope import apply_rope, rope_frequencies, rope_tables
from tetrad.model.sharding import logical_init, spec_of
from tetrad.parallel.data import GradReducer
from tetrad.dist.layout import Layout
from tetrad.dist.topology import Topology
from tetrad.train.trainer import build_model

SEED = 0


# ----------------------------------------------------------------------------- torch's model
# Plain nn.Linear / nn.Embedding / nn.RMSNorm (what parallelize_module shards), named like
# tetrad's parameters so the logical weights load by name.

class _Attention(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.hd = m.head_dim
        self.wq = nn.Linear(m.d_model, m.n_heads * m.head_dim, bias=False)
        self.wk = nn.Linear(m.d_model, m.n_kv_heads * m.head_dim, bias=False)
        self.wv = nn.Linear(m.d_model, m.n_kv_heads * m.head_dim, bias=False)
        self.wo = nn.Linear(m.n_heads * m.head_dim, m.d_model, bias=False)

    def forward(self, x, cos, sin):
        b, s = x.shape[:2]
        q = self.wq(x).view(b, s, -1, self.hd)  # this rank's heads (local tensors)
        k, v = self.wk(x).view(b, s, -1, self.hd), self.wv(x).view(b, s, -1, self.hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=k.shape[2] != q.shape[2])
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class _MLP(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.w1 = nn.Linear(m.d_model, m.ffn_hidden, bias=False)
        self.w3 = nn.Linear(m.d_model, m.ffn_hidden, bias=False)
        self.w2 = nn.Linear(m.ffn_hidden, m.d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(m.d_model, m.norm_eps), nn.RMSNorm(m.d_model, m.norm_eps)
        self.attn, self.mlp = _Attention(m), _MLP(m)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TorchLlama(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.embed = nn.Embedding(m.vocab_size, m.d_model)
        self.layers = nn.ModuleDict({str(i): _Block(m) for i in range(m.n_layers)})
        self.norm = nn.RMSNorm(m.d_model, m.norm_eps)
        self.head = nn.Linear(m.d_model, m.vocab_size, bias=False)
        self.rope = rope_tables(torch.arange(m.seq_len), m, rope_frequencies(m, torch.device("cpu")))

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.layers.values():
            h = block(h, *self.rope)
        return self.head(self.norm(h))


def parallelize_torch(model: TorchLlama, mesh, sequence_parallel: bool) -> None:
    """torchtitan's Llama plan: column q/k/v/w1/w3, row wo/w2, vocab-split embedding and head;
    with SP the norms run on Shard(1) (sequence) and row outputs are reduce-scattered to it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    seq = Shard(1) if sequence_parallel else Replicate()
    top = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=seq),
                "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=seq)}
        if sequence_parallel:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                         "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                    desired_input_layouts=(Replicate(), None, None)),
                         "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        parallelize_module(block, mesh, plan)


# ----------------------------------------------------------------------------- one rank

def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _rank(cfg, framework: str, batch: int, steps: int) -> dict:
    m, p = cfg.model, cfg.parallel
    topo = Topology(Layout(tp=p.tp), torch.device("cpu"))
    tetrad_model = build_model(cfg, topo)
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_len + 1), generator=gen)
    x, labels = tokens[:, :-1], tokens[:, 1:]
    n_tokens = labels.numel()
    if framework == "tetrad":
        model = tetrad_model
        positions = torch.arange(m.seq_len)
        # tetrad's own gradient path: fp32 buckets, and under SP the replicated parameters'
        # gradients summed over tp (what DTensor does inside torch's backward).
        reducer = GradReducer(list(model.parameters()), topo, p, model)

        def loss_and_backward():
            loss = model(x, positions, labels) / n_tokens
            with reducer.last_microbatch():
                loss.backward()
            reducer.reduce()
            return loss
    else:
        from torch.distributed.tensor.parallel import loss_parallel
        model = TorchLlama(m)
        with torch.no_grad():  # the same logical initial weights as tetrad's model
            for name, param in model.named_parameters():
                param.copy_(logical_init(name, spec_of(dict(tetrad_model.named_parameters())[name])[0], cfg.train.seed))
        del tetrad_model
        parallelize_torch(model, topo.mesh["tp"], p.sequence_parallel)

        def loss_and_backward():
            with loss_parallel():
                loss = F.cross_entropy(model(x).flatten(0, 1), labels.flatten(), reduction="sum") / n_tokens
                loss.backward()
            return loss
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    rss_before = _peak_rss_bytes()
    times, losses = [], []
    for _ in range(steps + 2):  # the first two steps warm up (allocator, Adam states)
        start = time.perf_counter()
        loss = loss_and_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        loss = loss.detach()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    return {"step_s": statistics.median(times[2:]), "peak_rss_rise": _peak_rss_bytes() - rss_before,
            "losses": losses}


def run(cfg, framework: str, batch: int, steps: int) -> dict:
    results = launch.run_local(_rank, cfg.parallel.tp, (cfg, framework, batch, steps))
    return {"step_s": max(r["step_s"] for r in results), "peak_rss_rise": max(r["peak_rss_rise"] for r in results),
            "losses": results[0]["losses"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    print(f"tp={a.tp}, {a.tp} gloo ranks, d_model {a.d_model}, {a.layers} layers, {a.heads}/{a.kv_heads} heads, "
          f"vocab {a.vocab}, seq {a.seq}, batch {a.batch}; median of {a.steps} steps after 2 warm-up, "
          f"best of {a.repeats} alternating rounds")
    print(f"{'SP':>8} | {'tetrad s/step':>13} | {'torch s/step':>12} | {'time ratio':>10} | "
          f"{'tetrad peak MiB':>15} | {'torch peak MiB':>14} | {'mem ratio':>9} | max |loss diff| over steps")
    for label, sp, regather in (("off", False, False), ("on", True, False), ("regather", True, True)):
        cfg = load_config(overrides={
            "model": {"n_layers": a.layers, "d_model": a.d_model, "n_heads": a.heads, "n_kv_heads": a.kv_heads,
                      "ffn_hidden": 4 * a.d_model * 2 // 3 // 64 * 64, "vocab_size": a.vocab, "seq_len": a.seq,
                      "norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "tie_embeddings": False},
            "parallel": {"tp": a.tp, "sequence_parallel": sp, "sp_regather": regather}})
        rounds = {"tetrad": [], "torch": []}
        for _ in range(a.repeats):
            for framework, results in rounds.items():
                results.append(run(cfg, framework, a.batch, a.steps))
        ours, theirs = (min(results, key=lambda r: r["step_s"]) for results in rounds.values())
        print(f"{label:>8} | {ours['step_s']:13.3f} | {theirs['step_s']:12.3f} | "
              f"{ours['step_s'] / theirs['step_s']:10.2f} | {ours['peak_rss_rise'] / 2**20:15.1f} | "
              f"{theirs['peak_rss_rise'] / 2**20:14.1f} | {ours['peak_rss_rise'] / theirs['peak_rss_rise']:9.2f} | "
              f"{max(abs(u - v) for u, v in zip(ours['losses'], theirs['losses'])):.1e}")


if __name__ == "__main__":
    main()
