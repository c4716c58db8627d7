"""bench/gpu_check.py's `varlen` part (< 20 s on one GPU): masked attention over the whole
sequence through flash's varlen kernel (model/varlen.py), which the CPU suite runs only with a
reference kernel in its place, against the masked SDPA path it replaces (the memory-efficient
kernel with the additive bias, K/V heads repeated), in bf16 with documents and a sliding window
(flash's window (W - 1, 0)) and with documents alone (its is_causal): forward and backward
agreement and both times; and that per-op recompute (`selective-op`) keeps
the varlen kernel's output, so its backward runs no flash forward again."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tetrad import launch
from tetrad.model import attention as attn
from tetrad.model.documents import Documents
from tetrad.model.llama import _save_attention_and_every_other_matmul
from tetrad.model.masks import sequence_bias
from tetrad.model.replay import RingReplay
from tetrad.model.varlen import Packing

ROWS, SEQ, HEADS, KV_HEADS, DIM, WINDOW = 2, 4096, 16, 4, 128, 1024


def _masked(q, k, v, bias):
    """The path varlen replaces: SDPA with the bias over repeated K/V heads (efficient kernel)."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.repeat_interleave(groups, 2).transpose(1, 2), v.repeat_interleave(groups, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2)


def _timed(run, q, k, v, dout, reps: int = 3):
    """(milliseconds of forward + backward, the last output and q, k, v gradients)."""
    for rep in range(reps + 1):  # the first: warm-up
        if rep == 1:
            torch.cuda.synchronize()
            start = time.perf_counter()
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = run(*leaves)
        out.backward(dout)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / reps, [out.detach()] + [t.grad for t in leaves]


def _flash_forward_kernels(run) -> int:
    """CUDA flash forward kernels that `run()` launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "flash_fwd" in e.name)


def _flash_forwards(q, k, v, dout, docs) -> tuple[int, int]:
    """Flash forward kernels in the forward and in the backward of a `selective-op`-checkpointed
    varlen call: the forward's must be seen, else a profiler that records no kernel (or another
    kernel name) would pass the backward's none."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = []
    in_forward = _flash_forward_kernels(lambda: out.append(checkpoint(
        lambda q, k, v: attn.local_attention(q, k, v, docs, WINDOW), *leaves, use_reentrant=False,
        context_fn=lambda: _save_attention_and_every_other_matmul(RingReplay()))))
    return in_forward, _flash_forward_kernels(lambda: out[0].backward(dout))


def _agreement(q, k, v, dout, docs, window: int) -> tuple:
    """The varlen path (which sequence_mask must choose) against the masked SDPA path: a row."""
    dev = q.device
    chosen = attn.sequence_mask(docs, window, ROWS, SEQ, torch.bfloat16, dev, DIM)
    bias = sequence_bias(docs, window, SEQ, torch.bfloat16, dev)
    ms_varlen, got = _timed(lambda q, k, v: attn.local_attention(q, k, v, docs, window), q, k, v, dout)
    ms_masked, want = _timed(lambda q, k, v: _masked(q, k, v, bias), q, k, v, dout)
    rel = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, want))
    return (f"varlen attention bf16, documents{f' + window {window}' if window else ''}, {ROWS}x{SEQ} GQA",
            isinstance(chosen, Packing) and rel < 3e-2, f"chose {type(chosen).__name__}; varlen {ms_varlen:.1f} ms, "
            f"masked SDPA {ms_masked:.1f} ms (fwd+bwd); max |Δ| / max of out, dq, dk, dv {rel:.1e}")


def _varlen_rank(device: str) -> list[tuple]:
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 50, (ROWS, SEQ), generator=g)
    tokens[torch.rand(ROWS, SEQ, generator=g) < 1 / 600] = 0  # documents of ~600 tokens
    docs = Documents.of_windows(tokens, 0, dev)
    q, dout = (torch.randn(ROWS, SEQ, HEADS, DIM, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(ROWS, SEQ, KV_HEADS, DIM, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    rows = [_agreement(q, k, v, dout, docs, window) for window in (WINDOW, 0)]  # 0: flash's is_causal path
    in_forward, forwards = _flash_forwards(q, k, v, dout, docs)
    return rows + [("varlen kept by selective-op", in_forward > 0 and forwards == 0,
                    f"{in_forward} flash forward kernels in the forward, {forwards} in the backward")]


def varlen_attention(device_type: str = "cuda") -> list[tuple]:
    return launch.run_local(_varlen_rank, 1, (device_type,), device_type=device_type, spawn=True)[0]
