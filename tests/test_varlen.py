"""Masked attention through flash's varlen kernel (model/varlen.py), without a GPU: the kernel is
the `Packing`'s field, so here a reference of flash-attention's varlen contract (per segment,
causal, within flash's window_size) stands in for it, itself checked against a brute-force loop.
The packing (rows and documents as segments, the window as flash's (left, right), grouped heads)
must then give the masked SDPA path's outputs and gradients (fp32, on the CPU). Which kernel
runs where (choose_kernel) and what the planner costs for it are checked without a device too;
bench/gpu_check.py's `varlen` part runs the real kernel against the masked path on a GPU."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import run_ranks
from host_reads import HostReads
from tetrad.dist.layout import Layout
from tetrad.dist.sequence import shard_sequence
from tetrad.dist.topology import Topology
from tetrad.model import attention as attn
from tetrad.model.documents import Documents
from tetrad.model.varlen import MAX_SEGMENTS, flash_window, segment_bounds, sequence_packing

EOS = 0


def reference_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's contract on the CPU: q, k, v packed [tokens, heads,
    d]; each segment [cu[i], cu[i+1]) attended alone, the query at i seeing the keys i - left to
    i + right of its segment (flash-attention's window_size; -1: unbounded). Asserts what the
    real kernel needs: int32 bounds, the same for queries and keys, host ints that bound them."""
    assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
    bounds = cu_seq_q.tolist()
    assert isinstance(max_q, int) and max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:]))
    assert bounds[0] == 0 and bounds[-1] == q.shape[0] and enable_gqa == (k.shape[1] != q.shape[1])
    left, right = window_size
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
        visible = (j <= i + right if right >= 0 else torch.ones(b - a, b - a, dtype=torch.bool)) & \
            (j >= i - left if left >= 0 else True)
        seg = [t[a:b].transpose(0, 1) for t in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*seg, attn_mask=visible, enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(outs)


def _brute_force(q, k, v, bounds, left, right):
    """The same contract one query, head and key at a time."""
    out = torch.zeros_like(q)
    groups = q.shape[1] // k.shape[1]
    for a, b in zip(bounds, bounds[1:]):
        for i in range(a, b):
            keys = [j for j in range(a, b) if (right < 0 or j - i <= right) and (left < 0 or i - j <= left)]
            for h in range(q.shape[1]):
                scores = torch.stack([q[i, h] @ k[j, h // groups] for j in keys]) / q.shape[-1] ** 0.5
                out[i, h] = sum(p * v[j, h // groups] for p, j in zip(scores.softmax(0), keys))
    return out


def test_the_reference_kernel_is_flash_attentions_contract():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(9, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(9, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    bounds = [0, 1, 5, 9]
    cu = torch.tensor(bounds, dtype=torch.int32)
    for window in ((-1, 0), (1, 0), (2, 0), (-1, -1)):
        got = reference_varlen(q, k, v, cu, cu, 4, 4, window_size=window, enable_gqa=True)
        assert torch.allclose(got, _brute_force(q, k, v, bounds, *window)), window


def test_segment_bounds_come_from_the_host_ids():
    """Every row's start and every document's start cut a segment, rows end to end."""
    ids = np.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5], [0, 1, 2, 3, 4, 5]])
    bounds, longest = segment_bounds(ids, 3, 6)
    assert bounds.tolist() == [0, 2, 5, 6, 12, 13, 14, 15, 16, 17, 18] and bounds.dtype == np.int32
    assert longest == 6  # the row that is one document
    assert segment_bounds(ids[2:], 1, 6)[1] == 1  # many one-token documents
    bounds, longest = segment_bounds(None, 3, 6)  # a window alone: the rows
    assert bounds.tolist() == [0, 6, 12, 18] and longest == 6
    # a row that starts with the id the previous row ended with still starts a segment
    assert segment_bounds(np.array([[0, 0, 1], [1, 1, 1]]), 2, 3)[0].tolist() == [0, 2, 3, 6]


def test_flash_window_keeps_the_window_keys():
    """tetrad's window W sees i - W < j <= i: flash's left is W - 1; none hidden: causal."""
    assert flash_window(4, 16) == (3, 0)
    assert flash_window(0, 16) == flash_window(16, 16) == flash_window(20, 16) == (-1, 0)


def _documents(batch: int, seq: int, seed: int) -> Documents:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 9, (batch, seq), generator=g)
    tokens[torch.rand(batch, seq, generator=g) < 0.25] = EOS
    if batch > 2:
        tokens[1] = 3  # one document over the whole row
        tokens[2] = EOS  # one token a document
    return Documents.of_windows(tokens, EOS, torch.device("cpu"))


CASES = {  # name -> (batch, heads, kv_heads, documents, window)
    "documents": (2, 4, 4, True, 0),
    "window": (2, 4, 4, False, 5),
    "both": (2, 4, 4, True, 5),
    "rows-apart": (3, 4, 4, True, 3),  # a row one document, a row of one-token documents
    "gqa": (2, 4, 2, True, 5),
    "window-of-one": (1, 2, 1, False, 1),
}


def _inputs(batch, heads, kv_heads, documents, window, seq):
    g = torch.Generator().manual_seed(batch * 10 + kv_heads)
    q, k, v = (torch.randn(batch, seq, n, 8, generator=g) for n in (heads, kv_heads, kv_heads))
    dout = torch.randn(batch, seq, heads, 8, generator=g)
    return q, k, v, dout, _documents(batch, seq, seed=window) if documents else None


def _run(q, k, v, dout, run):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = run(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _varlen_and_masked(batch, heads, kv_heads, documents, window, seq=24):
    q, k, v, dout, docs = _inputs(batch, heads, kv_heads, documents, window, seq)
    packing = sequence_packing(docs, window, batch, seq, torch.device("cpu"), kernel=reference_varlen)
    # docs on the CPU: the masked SDPA path's bias
    return [_run(q, k, v, dout, lambda q, k, v: attn.local_attention(q, k, v, mask, window)) for mask in (packing, docs)]


@pytest.mark.parametrize("name", CASES)
def test_varlen_path_equals_the_masked_path(name):
    """Output and the q, k, v gradients of the packed path against SDPA with the bias."""
    varlen, masked = _varlen_and_masked(*CASES[name])
    for a, b in zip(varlen, masked):
        assert torch.allclose(a, b, atol=1e-5), (name, float((a - b).abs().max()))


def _alltoall_rank(cp, window):
    """All-to-all over cp ranks with the packing (documents crossing the ranks' chunks), against
    one process's masked path."""
    topo = Topology(Layout(cp=cp), torch.device("cpu"))
    rank = topo.local_rank("cp")
    q, k, v, dout, docs = _inputs(2, 4, 2, True, window, 32)
    expected = _run(q, k, v, dout, lambda q, k, v: attn.local_attention(q, k, v, docs, window))
    packing = sequence_packing(docs, window, 2, 32, torch.device("cpu"), kernel=reference_varlen)
    got = _run(*(shard_sequence(t, cp, rank, 1) for t in (q, k, v, dout)),
               lambda q, k, v: attn.attention(q, k, v, topo, "alltoall", docs=packing, window=window))
    return [float((a - shard_sequence(b, cp, rank, 1)).abs().max()) for a, b in zip(got, expected)]


@pytest.mark.dist
def test_alltoall_with_the_packing_matches_one_process():
    for errors in run_ranks(_alltoall_rank, 2, 2, 5):
        assert max(errors) < 1e-5, errors


def test_a_compiled_block_takes_new_segments_without_recompiling():
    """Each micro-batch's segments differ (their count, the longest): the varlen call runs
    outside torch.compile's graphs, so a compiled block neither recompiles nor specialises."""
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()

    def body(q, k, v, packing):
        return attn.local_attention(q * 1, k, v, packing) * 2
    compiled = torch.compile(body, backend=counter)
    q, k, v, _, _ = _inputs(2, 4, 2, False, 5, 24)
    frames = []
    for seed in (1, 2, 3, 4):
        packing = sequence_packing(_documents(2, 24, seed), 5, 2, 24, torch.device("cpu"), kernel=reference_varlen)
        assert torch.allclose(compiled(q, k, v, packing), body(q, k, v, packing))
        frames.append(counter.frame_count)
    assert frames == frames[:1] * 4, frames  # traced instead of eager, it recompiled for new segments


def test_more_segments_than_flashs_grid_takes_say_what_to_change():
    """A micro-batch of more documents than flash's launch grid has rows for (one-token documents:
    runs of end-of-document tokens) is refused with the cause, not a CUDA launch error."""
    assert segment_bounds(np.arange(MAX_SEGMENTS)[None], 1, MAX_SEGMENTS)[1] == 1
    with pytest.raises(ValueError, match="documents of a token or two"):
        segment_bounds(np.arange(MAX_SEGMENTS + 1)[None], 1, MAX_SEGMENTS + 1)


def test_the_packing_reads_nothing_from_the_device():
    """cu_seqlens and the longest segment come from the host ids (a read of the device ids would
    be a host sync per micro-batch on a GPU)."""
    docs = _documents(3, 24, seed=1)
    with HostReads() as counted:
        packing = sequence_packing(docs, 5, 3, 24, torch.device("cpu"))
    assert counted.reads == [] and packing.longest == 24 and packing.window == (4, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 100, 200, 256])
def test_varlen_is_chosen_on_cuda_in_16_bit_where_flash_takes_the_head_dim(dtype, head_dim):
    """Exactly on CUDA, in 16-bit, at a head dim flash's varlen takes, with a mask, over the whole
    sequence (not the ring's blocks); fp32 and other head dims keep the masked kernel."""
    flash = dtype != torch.float32 and head_dim % 8 == 0 and not 192 < head_dim <= 224
    for gqa in (False, True):
        chosen = attn.choose_kernel("cuda", dtype, gqa, "alltoall", masked=True, head_dim=head_dim)
        assert (chosen.name == "varlen") == flash and not (flash and chosen.expand_kv)
        assert attn.uses_varlen("cuda", dtype, head_dim) == flash
        assert attn.choose_kernel("cuda", dtype, gqa, "ring", masked=True, head_dim=head_dim).name != "varlen"
        assert attn.choose_kernel("cuda", dtype, gqa, "alltoall", head_dim=head_dim).name != "varlen"
        assert attn.choose_kernel("cpu", dtype, gqa, "alltoall", masked=True, head_dim=head_dim).name == "cpu_flash"
    assert not attn.uses_varlen("cpu", dtype, head_dim) and not attn.uses_varlen("xpu", dtype, head_dim)


@pytest.mark.parametrize("major", [7, 8, 9])
def test_a_gpu_older_than_ampere_takes_the_bias_and_not_flash(monkeypatch, major):
    """flash_api.cpp refuses compute capability < 8.0 before any kernel (mha_varlen_fwd's first
    check), and torch's varlen_attn has no other: a T4 or V100 training in fp16 (which the dtype
    check allows) with documents gets the masked path's bias, its ring blocks the memory-efficient
    kernel. Only the capability is asked (no allocation: this torch has no CUDA, so the bias is
    not made here, and a packing's pinned copy would raise)."""
    from types import SimpleNamespace
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(major=major, minor=0))
    gpu, flash = torch.device("cuda", 0), major >= 8
    assert attn.uses_varlen(gpu, torch.float16, 128) == flash and attn.uses_varlen("cuda", torch.float16, 128)
    for gqa in (False, True):
        ring = attn.choose_kernel(gpu, torch.float16, gqa, "ring", head_dim=128)
        assert ring == (attn.Kernel("flash", False) if flash else attn.Kernel("efficient", gqa))
        one_call = attn.choose_kernel(gpu, torch.float16, gqa, "alltoall", head_dim=128)
        assert one_call.name == ("flash" if flash else "efficient") and one_call.expand_kv == (gqa and not flash)
    if not flash:
        monkeypatch.setattr(attn, "sequence_bias", lambda docs, window, length, dtype, device: ("bias", device))
        assert attn.sequence_mask(_documents(2, 24, seed=1), 5, 2, 24, torch.float16, gpu, 128) == ("bias", gpu)


# ----------------------------------------------------------------------------- the planner

def _plan_cfg(dtype="bf16", head_dim=128, window=0, documents=False, cp=1, algo="alltoall"):
    from tetrad.config import load_config
    return load_config(overrides={
        "model": {"preset": "llama3-8b", "n_layers": 4, "d_model": 2048, "n_heads": 16, "n_kv_heads": 8,
                  "head_dim": head_dim, "ffn_hidden": 8192, "seq_len": 8192, "sliding_window": window},
        "parallel": {"cp": cp, "cp_algo": algo}, "train": {"dtype": dtype, "document_mask": documents, "micro_batch": 2}},
        runtime=False)


def _core(stack="tetrad", cluster="dgx-h100", **cfg):
    from tetrad.plan.hardware import load_cluster
    from tetrad.plan.layer import _attention_core
    from tetrad.plan.stacks import load_stack
    c = _plan_cfg(**cfg)
    return _attention_core(c, load_cluster(cluster).gpu, load_stack(stack), c.train.micro_batch * 8192 // c.parallel.cp)


def test_the_planner_costs_the_kernel_the_runtime_chooses():
    """bf16 (varlen: FlashAttention-2 over the band; documents: the causal half, their bound),
    fp32 and a head dim flash refuses (the bias kernel's whole square), the ring's blocks and
    other stacks (the causal half, as before)."""
    from tetrad.plan.hardware import load_gpu
    h100 = load_gpu("H100-SXM")
    fused_over_flash2 = h100.attention(True) / h100.attention(False)  # the fused kernel's speed-up
    plain = _core()[0]
    assert _core(documents=True)[0] == pytest.approx(plain * fused_over_flash2)
    # a window of S/4 keeps W - W^2/(2S) = 7S/32 keys a query of the causal half's S/2
    assert _core(window=2048)[0] == pytest.approx(_core(documents=True)[0] * 7 / 16)
    assert _core(window=2048, documents=True) == _core(window=2048)
    assert _core(dtype="fp32", documents=True)[0] == pytest.approx(2 * _core(dtype="fp32")[0])
    assert _core(head_dim=208, window=2048)[0] == pytest.approx(2 * _core(head_dim=208)[0] * fused_over_flash2)
    assert _core(cp=2, algo="ring", documents=True) == _core(cp=2, algo="ring")
    assert _core(cp=2, documents=True)[0] == pytest.approx(_core(cp=2)[0] * fused_over_flash2)
    assert _core(stack="megatron-core", documents=True) == _core(stack="megatron-core")
    assert _core(cluster="cpu", dtype="fp32", documents=True)[0] == pytest.approx(2 * _core(cluster="cpu", dtype="fp32")[0])


def test_the_planner_counts_no_bias_where_varlen_runs():
    from tetrad.plan.memory import mask_bias_bytes
    assert mask_bias_bytes(_plan_cfg(documents=True)) == 0.0
    assert mask_bias_bytes(_plan_cfg(window=2048)) == 0.0
    assert mask_bias_bytes(_plan_cfg(documents=True), is_cpu=True) == 2 * 8192 ** 2 * 2  # micro_batch 2 rows, bf16
    assert mask_bias_bytes(_plan_cfg(dtype="fp32", window=2048)) == 8192 ** 2 * 4
    assert mask_bias_bytes(_plan_cfg(cp=2, algo="ring", documents=True)) == 0.0


# ----------------------------------------------------------------------------- selective-op

def _reference_backward(dout, q, k, v, bounds, window):
    """dq, dk, dv of `reference_varlen` by attention's backward formulas (a CPU kernel runs below
    autograd: it cannot differentiate the reference itself)."""
    groups, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    left, right = window
    for a, b in zip(bounds, bounds[1:]):
        i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
        visible = ((j <= i + right) if right >= 0 else True) & ((j >= i - left) if left >= 0 else True)
        qh, do = q[a:b].transpose(0, 1), dout[a:b].transpose(0, 1)
        kh, vh = (t[a:b].transpose(0, 1).repeat_interleave(groups, 0) for t in (k, v))
        p = (qh @ kh.transpose(1, 2) * scale).masked_fill(~visible, float("-inf")).softmax(-1)
        ds = p * (do @ vh.transpose(1, 2) - (do * (p @ vh)).sum(-1, keepdim=True))
        for grad, part in zip(grads, (ds @ kh * scale, ds.transpose(1, 2) @ qh * scale, p.transpose(1, 2) @ do)):
            grad[a:b] += part.unflatten(0, (grad.shape[1], -1)).sum(1).transpose(0, 1)
    return grads


def _cpu_varlen_op(calls: list):
    """torch's own varlen op (torch_attn::_varlen_attn, its autograd and backward op) given CPU
    kernels of the reference: `calls` records which kernel ran."""
    from torch.nn.attention import varlen

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None, window_size=None, enable_gqa=False,
                seqused_k=None, block_table=None, num_splits=None):
        calls.append("forward")
        out = reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size=tuple(window_size), enable_gqa=enable_gqa)
        return out, torch.zeros(q.shape[1], q.shape[0]), torch.zeros(2, dtype=torch.uint64)

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, rng_state, scale=None, window_size=None):
        calls.append("backward")
        return tuple(_reference_backward(dout, q, k, v, cu_q.tolist(), tuple(window_size)))
    varlen._varlen_attn.register_kernel("cpu")(forward)
    varlen._varlen_attn_backward.register_kernel("cpu")(backward)
    return varlen.varlen_attn


def test_selective_op_keeps_the_varlen_kernels_output():
    """Per-op recompute (recompute=selective-op) keeps the varlen op's outputs, as it keeps SDPA's:
    its backward runs no second forward kernel (bench/gpu_check.py's varlen part checks the same
    of flash on a GPU), and the gradients are those of no recompute."""
    from torch.utils.checkpoint import checkpoint
    from tetrad.model.llama import _save_attention_and_every_other_matmul
    from tetrad.model.replay import RingReplay
    from tetrad.model.varlen import varlen_attention
    calls = []
    q, k, v, dout, docs = _inputs(*CASES["gqa"], seq=24)
    packing = sequence_packing(docs, 5, 2, 24, torch.device("cpu"), kernel=_cpu_varlen_op(calls))
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))

    def block(q, k, v):
        return varlen_attention(q @ w, k, v, packing) @ w
    contexts = _save_attention_and_every_other_matmul(RingReplay())
    kept = _run(q, k, v, dout, lambda *t: checkpoint(block, *t, use_reentrant=False, context_fn=lambda: contexts))
    assert calls == ["forward", "backward"], calls
    expected = _run(q, k, v, dout, block)
    masked = _run(q, k, v, dout, lambda q, k, v: attn.local_attention(q @ w, k, v, docs, 5) @ w)
    for a, b, c in zip(kept, expected, masked):
        assert torch.equal(a, b) and torch.allclose(a, c, atol=1e-5)
