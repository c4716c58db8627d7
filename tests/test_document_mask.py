"""Document masking (train.document_mask): a token attends only to earlier tokens of its own
document. Proven against running each document on its own, then every layout against one process
with the mask on; the ring's merge of a block row that sees no key is checked apart."""

from fractions import Fraction
from functools import lru_cache

import pytest
import torch

from conftest import DOC_EOS as EOS, assert_all_within, assert_parity, doc_shards, rank_histories, run_ranks, \
    tiny_config, train_layout
from tetrad.config import ConfigError
from tetrad.data.checks import check_data
from tetrad.data.sources import load_tokens
from tetrad.dist.layout import Layout
from tetrad.dist.sequence import shard_sequence
from tetrad.dist.topology import Topology
from tetrad.model import attention as attn
from tetrad.model.documents import Documents, document_ids
from tetrad.model.masks import RingMasks, ring_blocks
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import load_cluster
from tetrad.train.batches import Batches
from tetrad.train.memory import ActivationMeter
from tetrad.train.trainer import build_model



def _documents(seq: int, batch: int = 2, seed: int = 0, eos_share: float = 0.25) -> Documents:
    """The documents of `batch` windows of many short documents (2 to 7 tokens at the default
    share of EOS tokens), cut apart."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 9, (batch, seq), generator=g)
    tokens[torch.rand(batch, seq, generator=g) < eos_share] = EOS
    return Documents.of_windows(tokens, EOS, torch.device("cpu"))


def _spans(docs_row: torch.Tensor) -> list[tuple[int, int]]:
    ids = docs_row.tolist()
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
    return list(zip(starts, starts[1:] + [len(ids)]))


def test_document_ids_give_the_eos_to_the_document_it_ends():
    tokens = torch.tensor([[5, EOS, 7, 8, EOS, EOS, 3]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 1, 1, 1, 2, 3]]


def test_masked_dispatch_takes_a_kernel_with_a_mask():
    """The ring's masked blocks and fp32 take the memory-efficient kernel's bias; a bf16 whole
    sequence takes flash's varlen kernel (model/varlen.py; tests/test_varlen.py)."""
    for dtype in (torch.float32, torch.bfloat16):
        for algo in ("ring", "alltoall"):
            varlen = dtype == torch.bfloat16 and algo == "alltoall"
            assert attn.choose_kernel("cuda", dtype, True, algo, True, masked=True).name == \
                ("varlen" if varlen else "efficient")
            assert attn.choose_kernel("cpu", dtype, True, algo, masked=True).name == "cpu_flash"


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 2), (torch.bfloat16, 2), (torch.bfloat16, 1)])
def test_masked_cuda_kernel_calls_on_meta(dtype, rows):
    """The memory-efficient kernel's calls with a document mask (its bias over every head, rows
    padded to 16 elements), or a sliding window's, one row for the batch (`rows` 1), through
    torch's meta kernels: shapes as unmasked (no GPU here; as tests/test_attention_kernels.py
    checks the unmasked calls)."""
    q = torch.empty(2, 4, 40, 64, dtype=dtype, device="meta")
    k = v = torch.empty(2, 4, 24, 64, dtype=dtype, device="meta")
    visible = torch.empty(rows, 1, 40, 24, dtype=torch.bool, device="meta")
    out, lse = attn._block_forward(q, k, v, False, "efficient", visible)
    assert out.shape == q.shape and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    grads = attn._block_backward(torch.empty_like(out), q, k, v, out, lse, False, "efficient", visible)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]


# ----------------------------------------------------------------------------- one process

def _apart_reference():
    """Masked attention over whole windows, and each document attended on its own."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 24, n, 8, generator=g, requires_grad=True) for n in (4, 2, 2))
    dout = torch.randn(2, 24, 4, 8, generator=g)
    docs = _documents(24)
    out = attn.local_attention(q, k, v, docs)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    errors = []
    for row in range(2):
        for a, b in _spans(docs.ids[row]):
            part = [t[row:row + 1, a:b].detach().requires_grad_() for t in (q, k, v)]
            alone = attn.local_attention(*part)
            alone_grads = torch.autograd.grad(alone, part, dout[row:row + 1, a:b])
            errors.append(float((out[row:row + 1, a:b] - alone).abs().max()))
            errors += [float((g[row:row + 1, a:b] - ag).abs().max()) for g, ag in zip(grads, alone_grads)]
    return errors


def test_masked_attention_equals_each_document_alone():
    # fp32, the same kernel over fewer keys: only summation order differs (a few ulps of O(1)
    # values; measured 1.2e-6 on a gradient).
    assert_all_within(run_ranks(_apart_reference, 1)[0], 1e-5)


def _model_apart():
    """The model's logits over whole windows with the mask equal each document's alone, at the
    document's own positions (RoPE runs on through the window)."""
    cfg = tiny_config()
    model = build_model(cfg, Topology.single())
    g = torch.Generator().manual_seed(2)
    x = torch.randint(1, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=g)
    x[torch.rand(x.shape, generator=g) < 0.15] = EOS
    docs, positions = Documents.of_windows(x, EOS, torch.device("cpu")), torch.arange(cfg.model.seq_len)
    with torch.no_grad():
        logits = model(x, positions, docs=docs)
        unmasked = model(x, positions)
        errors = [float((logits[r:r + 1, a:b] - model(x[r:r + 1, a:b], positions[a:b])).abs().max())
                  for r in range(2) for a, b in _spans(docs.ids[r])]
    return errors, float((logits - unmasked).abs().max())


def test_model_with_mask_equals_each_document_alone():
    errors, masked_vs_not = run_ranks(_model_apart, 1)[0]
    assert_all_within(errors, 1e-5)
    assert masked_vs_not > 1e-2  # the windows do cross documents: the mask changes the logits


def _saved_by_depth():
    """Bytes autograd saves for one forward of 1 and 3 layers, with the mask and without."""
    out = {}
    for layers in (1, 3):
        cfg = tiny_config(model={"n_layers": layers, "seq_len": 64})
        model = build_model(cfg, Topology.single())
        x = torch.randint(1, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(4))
        x[:, ::7] = EOS
        for masked in (False, True):
            meter = ActivationMeter()
            with meter.measuring():
                model(x, torch.arange(64), docs=Documents.of_windows(x, EOS, torch.device("cpu")) if masked else None)
            out[layers, masked] = meter.peak
    return out


def test_the_layers_share_one_bias():
    """Without recompute every layer's attention keeps the same bias tensor (built once per
    micro-batch): the mask costs b x S^2 in the activations' dtype, at any depth."""
    saved = run_ranks(_saved_by_depth, 1)[0]
    for layers in (1, 3):
        assert saved[layers, True] - saved[layers, False] == 2 * 64 * 64 * 4


# ----------------------------------------------------------------------------- the ring's merge

def test_merge_takes_nothing_from_a_row_that_sees_no_key():
    """A block row whose keys are all masked: the kernels give it lse -inf (or, the CPU kernel,
    0 with the mask applied as -inf later) and an output of NaN or anything. The running
    result must stay as it was, forward, with no NaN."""
    out, lse = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4)
    blk_out, blk_lse = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4)
    blk_out[:, :, 1:3], blk_lse[:, :, 1:3] = float("nan"), float("-inf")
    merged, merged_lse = out.clone(), lse.clone()
    attn._merge(merged, merged_lse, slice(None), blk_out, blk_lse)
    assert not merged.isnan().any() and not merged_lse.isnan().any()
    torch.testing.assert_close(merged[:, :, 1:3], out[:, :, 1:3], rtol=0, atol=0)
    torch.testing.assert_close(merged_lse[:, :, 1:3], lse[:, :, 1:3], rtol=0, atol=0)
    # Both -inf (a row that has seen nothing yet) stays empty, not NaN.
    empty, empty_lse = torch.zeros(1, 2, 4, 8), torch.full((1, 2, 4), float("-inf"))
    attn._merge(empty, empty_lse, slice(None), blk_out, blk_lse)
    assert not empty.isnan().any() and empty_lse[:, :, 1:3].isneginf().all()


# The ring's choice of blocks, from the ids on the host, against the masks on the device:
# tests/test_sliding_window.py test_the_ring_computes_exactly_the_blocks_the_masks_leave
# (window 0 is document masking alone).


def _ring_reference(heads, kv_heads, window: int = 0, masked: bool = True):
    """One process's attention and gradients over 32 tokens, with documents (`masked`) and a
    sliding `window` (0: none; tests/test_sliding_window.py)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 32, n, 8, generator=g, requires_grad=True) for n in (heads, kv_heads, kv_heads))
    dout = torch.randn(2, 32, heads, 8, generator=g)
    docs = _documents(32, seed=3) if masked else None
    out = attn.local_attention(q, k, v, docs, window)
    out.backward(dout)
    return [t.detach() for t in (q, k, v, dout, out, q.grad, k.grad, v.grad)], docs


def _ring_rank(cp, cases, dtype, window: int = 0):
    """Each case on this cp rank, through `attention` (ring and all-to-all on the CPU kernel) and
    through the ring on the math kernel, whose masked rows give NaN outputs; inputs in `dtype`,
    errors against the fp32 reference (`_ring_reference`'s, at the same `window`)."""
    topo = Topology(Layout(cp=cp), torch.device("cpu"))
    rank, errors = topo.local_rank("cp"), {}
    for (heads, kv_heads), (tensors, docs) in cases.items():
        q, k, v, dout, *expected = (shard_sequence(t, cp, rank, 1) for t in tensors)
        q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
        runs = {algo: (lambda q, k, v, algo=algo: attn.attention(q, k, v, topo, algo, docs=docs, window=window))
                for algo in ("ring", "alltoall")}
        math = attn.Kernel("math", heads != kv_heads)
        masks = RingMasks(window, docs, ring_blocks(cp, rank, q.shape[1] // 2, window, docs and docs.host))
        runs["ring-math"] = lambda q, k, v: attn._RingAttention.apply(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), topo, math, None, masks).transpose(1, 2)
        for name, run in runs.items():
            q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
            out = run(q_, k_, v_)
            out.backward(dout)
            errors[name, heads, kv_heads] = [float((a.detach().float() - b).abs().max())
                                             for a, b in zip((out, q_.grad, k_.grad, v_.grad), expected)]
    return errors


@pytest.mark.dist
@pytest.mark.parametrize("cp,dtype", [(2, torch.float32), (4, torch.float32), (2, torch.bfloat16)])
def test_context_parallel_attention_matches_one_process(cp, dtype):
    """At cp=4 a rank's chunks are 4 tokens of documents of 2 to 7: many blocks see nothing
    (skipped) and many block rows see no key (merged as nothing)."""
    cases = {shape: run_ranks(_ring_reference, 1, *shape)[0] for shape in ((4, 4), (8, 4))}
    for errors in run_ranks(_ring_rank, cp, cp, cases, dtype):
        for errs in errors.values():
            # fp32: the ring's merge order (all-to-all exact). bf16 against fp32: the inputs'
            # and outputs' rounding (8 bits of O(1) values); measured 0.022 at most.
            assert_all_within(errs, 1e-5 if dtype == torch.float32 else 0.05)


# ----------------------------------------------------------------------------- training parity



LAYOUTS = {  # name -> (parallel, train, model)
    "cp2-ring": ({"cp": 2, "cp_algo": "ring"}, {}, {}),
    "cp4-ring-selective-op": ({"cp": 4, "cp_algo": "ring"}, {"recompute": "selective-op"}, {}),
    "cp2-alltoall": ({"cp": 2, "cp_algo": "alltoall"}, {}, {}),
    "pp2-zb": ({"pp": 2, "schedule": "zb"}, {}, {}),
    "pp2-vpp2-interleaved-full": ({"pp": 2, "vpp": 2, "schedule": "interleaved"}, {"recompute": "full"},
                                  {"n_layers": 4}),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, {}, {}),
    "dp2-zero3-selective": ({"dp": 2, "zero": 3}, {"recompute": "selective"}, {}),
}


def _config(parallel: dict, train: dict, model: dict):
    """TINY on the document shards, a validation at the last step."""
    return tiny_config(parallel=parallel, model=model, data={"source": doc_shards(), "val_fraction": 0.2},
                       train={"document_mask": True, "eval_every": 5, **train})


@lru_cache(maxsize=None)
def _train(name: str | None, masked: bool = True, n_layers: int = 2):
    parallel, train, model = LAYOUTS[name] if name else ({}, {"document_mask": masked}, {"n_layers": n_layers})
    return train_layout(_config(parallel, train, model))


@pytest.fixture(scope="module")
def references():
    """The one-process runs first (a forked single-rank job hangs once the pytest process has
    computed with its OpenMP pool)."""
    return {layers: _train(None, n_layers=layers) for layers in (2, 4)}


def test_the_mask_changes_training(references):
    unmasked = _train(None, masked=False)
    assert abs(unmasked[0][0] - references[2][0][0]) > 1e-3, (unmasked[0], references[2][0])


@pytest.mark.dist
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, references):
    # As tests/test_cp.py: fp32, only orders of sums differ (the ring's merge, tp pieces, dp x cp).
    layers = LAYOUTS[name][2].get("n_layers", 2)
    got, ref = _train(name), references[layers]
    assert_parity(got, ref, atol=2e-4, loss_atol=2e-6)
    assert got[2][-1]["val_loss"] == pytest.approx(ref[2][-1]["val_loss"], rel=1e-5)  # validation masks too


# ----------------------------------------------------------------------------- the planner

@pytest.mark.dist
@pytest.mark.parametrize("parallel,recompute", [({}, "none"), ({"cp": 2, "cp_algo": "alltoall"}, "none"),
                                                ({"cp": 2}, "none"), ({}, "selective")])
def test_counted_activations_match_the_estimate(parallel, recompute):
    """The mask SDPA keeps per layer (b x s^2 in the activations' dtype) is in the estimate where
    it is kept, as tests/test_plan_runtime.py checks the other layouts (within 15%): every rank's
    saved activations against the estimate's. A long window on a narrow model, so that the mask
    is a large share: without its term the estimate fell 25% and 43% under the count (cp=1,
    all-to-all); with it, the mask adds 4.00 MiB to both (2 layers x 2 x 512^2 x 4 B)."""
    cfg = tiny_config(model={"seq_len": 512},
                      parallel=parallel, data={"source": doc_shards()},
                      train={"steps": 2, "device": "cpu", "warmup": 1, "micro_batch": 2, "global_batch": 8,
                             "document_mask": True, "recompute": recompute})
    want = estimate(cfg, load_cluster("cpu")).memory_by_rank[0]
    for _, history in rank_histories(cfg):
        got = history[-1]["memory_bytes"]["activations"]
        print(f"estimate {(want.activations - want.transient) / 2**20:.2f} MiB, counted {got / 2**20:.2f} MiB")
        assert want.activations - want.transient == pytest.approx(got, rel=0.15), (want, got)


# ----------------------------------------------------------------------------- validation

def test_data_without_an_eos_is_refused():
    with pytest.raises(ConfigError, match=r"train.document_mask: 'licenses' does not say which token ends a "
                                          r"document.*tetrad data"):
        check_data(tiny_config(train={"document_mask": True}))
    check_data(tiny_config(train={"document_mask": True}, data={"source": doc_shards()}))


# ----------------------------------------------------------------------------- compile

@pytest.mark.dist
def test_compiled_layout_matches_single_process(references):
    """All-to-all's attention, mask built from the ids, runs inside the compiled block between
    the eager all-to-alls: no other graph break, no recompile after step 1 (the ids change every
    micro-batch, their shape does not)."""
    from test_compile import CountingTrainer
    cfg = _config({"cp": 2, "cp_algo": "alltoall"}, {"compile": True}, {})
    got = train_layout(cfg, trainer_class=CountingTrainer, timeout_s=900)
    frames = [record["frames_compiled"] for record in got[2]]
    assert frames[0] > 0 and frames == frames[:1] * len(frames), frames
    assert got[2][-1]["other_breaks"] == [], got[2][-1]["other_breaks"]
    assert_parity(got, references[2], atol=2e-4, loss_atol=2e-6)  # tests/test_compile.py's cp2 bounds


def test_each_source_of_a_blend_keeps_the_eos():
    """Validation evaluates a blend's sources apart (Batches.split): each part masks documents too."""
    tokens = load_tokens(doc_shards())
    blend = Batches([(Fraction(1, 2), tokens), (Fraction(1, 2), tokens)], 32, 4, 0, 256, shuffle=False, eos=EOS)
    x, _ = blend.global_batch_at(0)
    for _, part in blend.split():
        assert part.eos == EOS and torch.equal(part.documents(x, torch.device("cpu")).ids, document_ids(x, EOS))
